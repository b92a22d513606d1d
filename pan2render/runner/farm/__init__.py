"""The farm: the scheduler kept up as a service, serving every batch submitted to it.

``pan2-render farm start`` runs :mod:`~pan2render.runner.farm.service` in the background: one
process holding the Ray driver, the warm GPU groups, the durable queue (:mod:`.queue`) and a small
HTTP API (:mod:`.api`). Clients (the CLI's ``submit``, ``queue``, ``pause`` ... in :mod:`.commands`,
through :mod:`.client`) validate batches themselves and talk to it with the token kept in the
farm's folder.
"""
