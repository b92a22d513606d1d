"""The runner: the ``pan2-render`` commands, the farm, the scheduler they share, the executors and
the cluster, the GPU worker, and the protocol between them; one package per role.

Roles, top to bottom; a module imports only from its own role and the roles below it
(``tests/runner/test_roles.py`` walks every import, lazy ones included):

    cli       the commands
    farm      the scheduler kept up: service, durable queue, HTTP API, monitor
    serve     the scheduler `run` and the farm share: config, session, queue, stage flow, retries, watch
    views     read-only views of an output folder: status, show, report, compare, estimates
    cluster   where workers run: executors (Ray, in-process), the Ray cluster, the node, devices
    worker    the GPU side: the worker and what it runs
    protocol  what crosses between driver and workers: calls, replies, failures, step reports, artifacts

Below the runner: ``jobs`` (specs, ledger), ``media`` (mp4), ``models`` (only inside the worker).
"""
