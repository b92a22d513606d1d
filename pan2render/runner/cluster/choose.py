"""Which executor a run gets: the node kept up on this machine, a cluster named by ``--address``,
or a local cluster of the run's own (or, for tests, the in-process executor)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pan2render.runner.cluster.executor import Executor
from pan2render.runner.protocol.messages import WorkerConfig

if TYPE_CHECKING:
    from pan2render.runner.cluster.ray_executor import RayExecutor


def _joined(executor: RayExecutor, say: Callable[[str], None]) -> RayExecutor:
    """Say which cluster a run joined and whose it is (another user's `ray start` is joined as
    readily as one's own), and how many GPUs it has free."""
    from pan2render.runner.cluster.node import read_record
    from pan2render.runner.cluster.ray_cluster import whose

    gcs = executor.gcs_address
    if gcs:
        record = read_record()
        owner = whose(gcs, kept_up_here=record.gcs_address if record is not None else None)
        say(f"joined {executor.cluster}: {owner}; {executor.total_gpus()} GPU(s), {executor.free_gpus()} free now "
            f"(`--address local` runs on a cluster of this run's own)")
    return executor



LOCAL_ADDRESS = "local"  # --address local: a cluster of this run's own, even with a node kept up here


def local_gpus(cpu_gpus: int | None, *, max_gpus: int) -> tuple[int, int, str | None]:
    """(GPUs a local cluster gets, CUDA devices found, a note for the user when they are logical).
    The devices are counted through NVML, without importing torch (`runner/cluster/devices.py`)."""
    from pan2render.runner.cluster.devices import cuda_gpu_count

    cuda = cuda_gpu_count()
    if cpu_gpus is not None:
        return cpu_gpus, cuda, None
    if cuda:
        return cuda, cuda, None
    # A CPU-only machine: logical GPUs, enough for the largest group.
    return max_gpus, 0, (f"no CUDA GPU found: running on CPU with {max_gpus} logical GPU(s) "
                         f"(set --cpu-gpus N to change)")


def make_executor(*, address: str | None, cpu_gpus: int | None, max_gpus: int,
                  say: Callable[[str], None], note: Callable[[str], None] | None = None,
                  cluster_record: Path | None = None, started_by: str = "run") -> Executor:
    """The executor for a run: ``address`` (a cluster to join, ``local`` for a cluster of the
    run's own, None for the node kept up on this machine if one runs, else a local cluster),
    ``cpu_gpus`` logical GPUs on a CPU-only machine, ``max_gpus`` the largest group the batch
    needs; ``note``: where lines for the run log alone go (default ``say``); ``cluster_record``:
    where a local cluster started here records its processes, for the next start to end should
    this process be killed (the farm's folder; None: the runs' records, `cluster/leftovers.py`);
    ``started_by``: what a local cluster is named after ("run", "farm").
    What killed runs and farms left of their local clusters is ended first. The test hooks of the
    environment (``PAN2_RENDER_EXECUTOR``, ``PAN2_RENDER_PIPELINE``, ``PAN2_RENDER_FAULTS``: see
    ``cli/main.py``) are read here."""
    import json

    from pan2render.runner.protocol.messages import DEFAULT_PIPELINE_FACTORY

    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")  # no uv-run runtime env probing
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    faults = json.loads(os.environ.get("PAN2_RENDER_FAULTS", "{}"))
    factory = os.environ.get("PAN2_RENDER_PIPELINE", DEFAULT_PIPELINE_FACTORY)
    config = WorkerConfig(pipeline_factory=factory, faults=faults)
    if os.environ.get("PAN2_RENDER_EXECUTOR") == "local":
        from pan2render.runner.cluster.local_executor import LocalExecutor

        return LocalExecutor(gpus=cpu_gpus or max_gpus, config=config)
    from pan2render.runner.cluster.leftovers import end_leftovers, records_to_check, run_record_path
    from pan2render.runner.cluster.ray_cluster import keep_ray_token_private, loopback_only

    for line in end_leftovers(records_to_check(cluster_record)):
        say(line)
    if token_note := keep_ray_token_private():
        say(token_note)
    # A local cluster may start: Ray reads the switch when it is imported (a run joining the node
    # kept up here takes that node's address still).
    with loopback_only() if address in (None, LOCAL_ADDRESS) else contextlib.nullcontext():
        import ray  # ~1 s; only a run that renders gets here

    from pan2render.runner.cluster.ray_cluster import ray_banner_to, running_local_node
    from pan2render.runner.cluster.ray_executor import RayExecutor

    ray_banner_to(note or say)
    node, node_note = running_local_node() if address is None and not ray.is_initialized() else (None, None)

    if address not in (None, LOCAL_ADDRESS):
        return _joined(RayExecutor(address=address, gpus=None, cpus=None, config=config), say)
    if address is None and not ray.is_initialized():
        if node_note:
            say(node_note)
        if node is not None:
            if cpu_gpus is not None:
                say(f"--cpu-gpus {cpu_gpus} is not used: the Ray node running on this machine has its own "
                    f"GPUs (`--address local` runs on a cluster of this run's own)")
            return _joined(RayExecutor(address=node, gpus=None, cpus=None, local_node=True, config=config), say)
    gpus, cuda, why = local_gpus(cpu_gpus, max_gpus=max_gpus)
    if ray.is_initialized():  # embedded in a process already connected to a cluster (tests)
        gpus = int(ray.cluster_resources().get("GPU", 0)) or 1
    elif why:
        say(why)
    cpus = os.cpu_count() or 1
    threads = None if cuda and cpu_gpus is None else max(1, cpus // gpus)
    executor = RayExecutor(address=None, gpus=gpus, cpus=cpus,
                           config=WorkerConfig(pipeline_factory=factory, faults=faults, threads=threads),
                           record=cluster_record or run_record_path(), started_by=started_by)
    if token_note := keep_ray_token_private():  # Ray wrote it meanwhile (another Ray starting)
        say(token_note)
    return executor

