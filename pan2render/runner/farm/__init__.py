"""The farm: the scheduler kept up as a service, serving every batch submitted to it.

``pan2-render farm start`` runs :mod:`~pan2render.runner.farm.service` in the background: one
process holding the Ray driver, the warm GPU groups, the durable queue (:mod:`.queue`) and a small
HTTP API (:mod:`.api`), with a child process that writes the served batches' reports
(:mod:`.reports`). Clients (the CLI's ``submit``, ``queue``, ``pause`` ... in
:mod:`pan2render.runner.cli.farm`, through :mod:`pan2render.client`, or any HTTP client) send a
batch's YAML, which the farm validates itself (:mod:`.intake`), with a user's token.
"""
