"""Worker groups and the one narrow interface the driver uses to reach them.

An :class:`Executor` makes groups of N workers (one per GPU) and runs *collective calls* on them:
``call(group, message)`` runs ``RenderWorker.execute(message)`` on every rank (``message``: one of
the typed calls of ``messages.py``) and ``result(call)`` returns rank 0's
:class:`~pan2render.runner.messages.Reply` (or the first failing rank's), or raises
:class:`GroupDied` when a worker process is gone. Two implementations:

- :class:`RayExecutor`: one actor per GPU, the group's actors in one STRICT_PACK placement group,
  joined into a torch.distributed group (NCCL on GPUs, gloo on CPU) with the rendezvous on rank
  0's node.
- :class:`LocalExecutor`: the same calls on in-process workers, for fast unit tests of the driver.
  It does not form a torch.distributed group (a group of N is one world-size-1 worker). GPU-lane
  calls run at ``call`` time; an I/O-lane call (the collect) runs on a thread and is ready when
  that job's background encode is, so the driver's tests see the same two lanes as on Ray.

:class:`GroupPool` keeps idle groups per size so models stay loaded between jobs, and tears idle
groups of other sizes down when a job needs their GPUs. Where the executor says so
(``starts_in_background``: Ray, where a start waits for a placement group, up to the start timeout
on a busy shared cluster, and then for the actors' processes and their process group) the pool
creates a group on a background thread, so the driver keeps serving the running jobs meanwhile.

A :class:`RayExecutor` also watches its cluster. A call that fails because its group's node left
the cluster says so (its GroupDied's kind is cluster-lost): the failure is the cluster's, not the
job's. And a GCS that stops accepting connections is noticed by probing its port
(:class:`GcsWatch`), since Ray's own calls that need the GCS then block until Ray ends the driver:
``check_cluster`` raises :class:`GcsLost` before that, while the driver can still put its jobs
back and say so.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
import traceback
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Protocol

from pan2render.runner.messages import (
    GPU_QUEUE_DEPTH,
    IO_CONCURRENCY,
    InitGroupCall,
    Lane,
    RendezvousCall,
    Reply,
    WorkerCall,
    WorkerConfig,
)
from pan2render.runner.progress import StepClock, StepReport
from pan2render.runner.retry import ClusterLostError, FailureKind, classify_group_death

# The worker (``worker.py``) imports torch and, on its first load, the model code: seconds that the
# driver never needs. Only the processes that run workers import it: Ray's actors through
# `RayWorkerProcess`, the in-process executor when it makes its first group.


class GroupDied(RuntimeError):
    """A worker of the group died or stopped answering; the group must be torn down. ``kind``:
    its failure class, from the type of what Ray raised (retry.classify_group_death), or
    cluster-lost when the group's node left the cluster (the failure is then not the job's)."""

    def __init__(self, message: str, *, kind: FailureKind = FailureKind.WORKER_DEATH):
        super().__init__(message)
        self.kind = kind


class GcsLost(ClusterLostError):
    """The cluster's GCS (on its head node) stopped accepting connections for longer than
    :func:`gcs_lost_after_s`: the head node or its GCS process died."""


class ClusterConnectError(RuntimeError):
    """``--address`` names no reachable Ray cluster (or one we may not join)."""


RAY_CLIENT_SCHEME = "ray://"  # a Ray client connection: needs the `ray[client]` extra (grpcio)


def ray_client_missing(address: str | None) -> str | None:
    """Why ``address`` cannot be joined from this install, checked before anything is written:
    a ``ray://`` address needs Ray's client extra. None when nothing is missing."""
    if address is None or not address.startswith(RAY_CLIENT_SCHEME):
        return None
    try:
        import grpc  # noqa: F401, PLC0415 - what ray[client] adds
    except ImportError:
        return (f"--address {address}: a ray:// address needs Ray's client extra, which is not installed; "
                f"install it with `pip install 'pan2-render[client]'` (or `pip install 'ray[client]'`), or "
                f"run on a node of the cluster with --address auto")
    return None


# ---------------------------------------------------------------------- a render node kept up
def node_start_command(*, gpus: int, port: int) -> list[str]:
    """``ray start`` for a head node on this machine that runs join (`running_local_node`): ``gpus``
    GPUs (logical on a CPU-only machine), no dashboard (slow to start, not needed). Its CPU count is
    its GPU count: the runner's actors take no CPU, and Ray keeps one idle worker process per CPU
    it counts."""
    import sys  # noqa: PLC0415

    return [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
            f"--num-gpus={gpus}", f"--num-cpus={gpus}", "--include-dashboard=false", "--disable-usage-stats"]


def running_local_node() -> tuple[str | None, str | None]:
    """(GCS address of the Ray node that `ray start` left running on this machine, or None; a note
    when one is recorded but does not answer). ``ray.init()`` without an address joins that node
    itself, and then refuses the resources a new local cluster is started with: so a run looks
    first. Ray records the node for that purpose (`ray start` writes it, `ray stop` removes it) but
    offers no public call that reads it, hence the one private import, guarded."""
    try:
        from ray._private.services import find_bootstrap_address  # noqa: PLC0415
    except ImportError:
        return None, None
    address = find_bootstrap_address(None)
    if not address:
        return None, None
    target = GcsWatch.parse(address)
    if target is None:
        return None, None
    try:
        socket.create_connection(target, timeout=2).close()
    except OSError as e:
        return None, (f"the Ray node recorded on this machine ({address}) does not answer ({e}): it was "
                      f"stopped without `ray stop`; starting a local cluster instead")
    return address, None


class GroupStartError(RuntimeError):
    """A group could not be formed (placement group not ready, rendezvous failed)."""


@dataclass
class Group:
    id: str
    size: int
    handle: Any  # executor-specific: actors + placement group, or local workers
    models: set[str] = field(default_factory=set)  # models loaded on every rank
    next_seq: int = 0  # number of the next GPU-lane call (the workers run them in this order)
    # When the executor was asked for it and when it was placed (its GPUs granted, its actors
    # created, a group of several joined into its process group), as time.time(): the run log's
    # start-up lines. 0.0: not known.
    asked_at: float = 0.0
    placed_at: float = 0.0

    def take_seq(self, message: WorkerCall) -> int | None:
        """The GPU-lane number for ``message`` (None off the GPU lane)."""
        if message.lane is not Lane.GPU:
            return None
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        return seq


@dataclass
class Call:
    """A message in flight to a group."""

    group: Group
    message: WorkerCall
    started: float
    timeout_s: float
    handle: Any  # executor-specific: object refs, or the finished reply


class Executor(Protocol):
    starts_in_background: bool  # GroupPool runs create_group on a thread (it blocks for long)
    worker_logs: str | None  # where the workers' own logs are, to tell the user once
    cluster: str  # how messages name the cluster ("the Ray cluster at HOST:PORT")

    def total_gpus(self) -> int: ...
    def max_group_size(self) -> int: ...  # most GPUs on one node (a group is STRICT_PACK)
    def create_group(self, size: int, *, timeout_s: float) -> Group: ...
    def destroy_group(self, group: Group) -> None: ...
    def call(self, group: Group, message: WorkerCall, *, timeout_s: float) -> Call: ...
    def wait(self, calls: Sequence[Call], *, timeout_s: float) -> list[Call]: ...
    def result(self, call: Call) -> Reply[Any]: ...
    def progress(self) -> dict[str, StepReport]: ...
    def check_cluster(self) -> None: ...  # raises ClusterLostError when the cluster is gone
    def shutdown(self) -> None: ...


_ids = itertools.count()


def _first_failure(replies: list[Reply[Any]]) -> Reply[Any]:
    for r in replies:
        if not r.ok:
            return r
    return replies[0]


# ====================================================================== in-process
class LocalExecutor:
    """Runs each GPU-lane call synchronously at ``call`` time, in this process; an I/O-lane call
    on a thread (it waits for the worker's encode thread)."""

    starts_in_background = False  # a group is one in-process object: nothing to wait for
    worker_logs = None  # the workers log where this process does
    cluster = "the in-process cluster"

    def __init__(self, *, gpus: int, config: WorkerConfig):
        self._gpus = gpus
        self._config = config
        self._progress = StepClock()
        self._io = futures.ThreadPoolExecutor(max_workers=4 * IO_CONCURRENCY, thread_name_prefix="local-io")
        self.groups_created = 0

    def total_gpus(self) -> int:
        return self._gpus

    def max_group_size(self) -> int:
        return self._gpus

    def create_group(self, size: int, *, timeout_s: float) -> Group:
        from pan2render.runner.worker import RenderWorker, _WorkerDeath  # noqa: PLC0415 - torch

        def die() -> None:
            raise _WorkerDeath()

        asked = time.time()
        worker = RenderWorker(rank=0, world_size=1, config=self._config, progress=self._progress, die=die)
        self.groups_created += 1
        return Group(id=f"local-{next(_ids)}", size=size, handle={"worker": worker, "dead": False},
                     asked_at=asked, placed_at=time.time())

    def destroy_group(self, group: Group) -> None:
        group.handle["dead"] = True

    def call(self, group: Group, message: WorkerCall, *, timeout_s: float) -> Call:
        seq = group.take_seq(message)
        started = time.monotonic()
        if message.lane is Lane.IO:
            handle: Any = self._io.submit(self._execute, group, message, seq)
        else:
            handle = self._execute(group, message, seq)
        return Call(group=group, message=message, started=started, timeout_s=timeout_s, handle=handle)

    @staticmethod
    def _execute(group: Group, message: WorkerCall, seq: int | None) -> Reply[Any] | GroupDied:
        from pan2render.runner.worker import _WorkerDeath  # noqa: PLC0415 - imported by create_group

        if group.handle["dead"]:
            return GroupDied(f"group {group.id} was torn down")
        try:
            return group.handle["worker"].execute(message, seq)
        except _WorkerDeath:
            group.handle["dead"] = True
            return GroupDied(f"worker rank 0 of group {group.id} died in {type(message).__name__}")

    def wait(self, calls: Sequence[Call], *, timeout_s: float) -> list[Call]:
        """The finished calls; waits up to ``timeout_s`` for one when only collects are running."""
        pending = [c.handle for c in calls if isinstance(c.handle, futures.Future)]
        if pending and len(pending) == len(calls):
            futures.wait(pending, timeout=timeout_s, return_when=futures.FIRST_COMPLETED)
        return [c for c in calls if not isinstance(c.handle, futures.Future) or c.handle.done()]

    def result(self, call: Call) -> Reply[Any]:
        outcome = call.handle.result() if isinstance(call.handle, futures.Future) else call.handle
        if isinstance(outcome, GroupDied):
            raise outcome
        if call.group.handle["dead"]:  # torn down while this call ran: its answer is void
            raise GroupDied(f"group {call.group.id} was torn down")
        return outcome

    def progress(self) -> dict[str, StepReport]:
        return self._progress.snapshot()

    def check_cluster(self) -> None:
        """An in-process cluster cannot be lost."""

    def shutdown(self) -> None:
        self._io.shutdown(wait=False, cancel_futures=True)


# ====================================================================== Ray
class RayExecutor:
    """Groups of Ray actors. ``address=None`` starts a local cluster with ``gpus`` logical GPUs.

    ``create_group`` may run on the pool's start thread while the driver thread calls the rest
    (Ray's API is thread-safe); ``_groups`` is shared between them under ``_lock``.
    """

    starts_in_background = True

    def __init__(self, *, address: str | None, gpus: int | None, cpus: int | None,
                 config: WorkerConfig, object_store_bytes: int = 1 << 30, local_node: bool = False):
        """``local_node``: ``address`` is the node kept up on this machine (`running_local_node`)."""
        import ray  # noqa: PLC0415 - importing ray costs ~1 s; unit tests with LocalExecutor skip it

        self._ray = ray
        self._config = config
        # Already connected (a test's module-wide cluster, or an embedding application): use that
        # cluster as it is and leave it running at shutdown.
        self._owns_ray = not ray.is_initialized()
        # Where Ray keeps the workers' own logs (this node's session folder), when we started or
        # joined Ray here; a Ray client (ray://) keeps them on the cluster's nodes.
        self.worker_logs: str | None = None
        context: Any = None
        if self._owns_ray and address is None:
            # A local cluster: no dashboard (slow to start, not needed), a modest object store
            # (artifacts are MBs: latents ~10 MB, an mp4 a few MB), worker logs shown here.
            # "local": a new cluster even where a node recorded on this machine is gone.
            context = ray.init(address="local", num_cpus=cpus, num_gpus=gpus, include_dashboard=False,
                               log_to_driver=True, object_store_memory=object_store_bytes,
                               logging_level="WARNING")
        elif self._owns_ray:
            probe_address(address)
            try:
                # The node kept up here is joined as Ray's "auto" finds it, the one way Ray takes its
                # token (token authentication, on by default) from ~/.ray without being told to.
                context = ray.init(address="auto" if local_node else address, log_to_driver=True,
                                   logging_level="WARNING")
            except (ConnectionError, RuntimeError) as e:
                raise ClusterConnectError(
                    f"could not join the Ray cluster at {address!r}: {str(e).splitlines()[0]}; check "
                    f"the address (`ray status` on the head node) and, where the cluster uses token "
                    f"authentication, that its token is in ~/.ray/auth_token or RAY_AUTH_TOKEN"
                ) from e
        session = (getattr(context, "address_info", None) or {}).get("session_dir")
        if session:
            self.worker_logs = f"{session}/logs"
        # A Ray client (ray://) reaches the cluster through its client server, not the GCS.
        self._gcs: GcsWatch | None = None
        self.cluster = f"the Ray cluster at {address}"
        gcs_address = None if (address or "").startswith(RAY_CLIENT_SCHEME) else \
            ray.get_runtime_context().gcs_address
        if gcs_address and GcsWatch.parse(gcs_address) is not None:
            self._gcs = GcsWatch(gcs_address)
            self.cluster = (f"the Ray node kept up on this machine (GCS at {gcs_address})" if local_node
                            else f"the Ray cluster at {gcs_address}" if address is not None or not self._owns_ray
                            else f"the local Ray cluster this run started (GCS at {gcs_address})")
        self._gcs_lost_after_s = gcs_lost_after_s()
        # GCS queries run here, each with a deadline: one that would block (the GCS died after the
        # last probe) leaves its thread stuck instead of the driver's loop.
        self._gcs_queries = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="gcs-query")
        # Two lanes per actor (worker.py): the default group runs the GPU lane with one thread per
        # call the driver may queue (the worker orders them by seq), "io" runs the I/O lane.
        self._actor_cls = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=GPU_QUEUE_DEPTH,
                                     concurrency_groups={"io": IO_CONCURRENCY})(RayWorkerProcess)
        self._progress_actor = ray.remote(StepClock).options(num_cpus=0).remote()
        self._groups: dict[str, Group] = {}
        self._lock = threading.Lock()

    def total_gpus(self) -> int:
        return int(self._ask_gcs(self._ray.cluster_resources).get("GPU", 0))

    def max_group_size(self) -> int:
        per_node = [n.get("Resources", {}).get("GPU", 0) for n in self._ask_gcs(self._ray.nodes) if n.get("Alive")]
        return int(max(per_node, default=0))

    def _ask_gcs(self, query: Any) -> Any:
        """``query()``, a Ray call that the GCS answers. With the GCS gone such a call blocks,
        deaf to signals, until Ray ends the process: so it is not made while the GCS refuses
        connections, and is given up (GcsLost) after a deadline."""
        if self._gcs is None:
            return query()
        if not self._gcs.probe():
            raise GcsLost(f"{self.cluster}: its GCS refuses connections")
        deadline = min(GCS_QUERY_TIMEOUT_S, self._gcs_lost_after_s / 2)
        try:
            return self._gcs_queries.submit(query).result(timeout=deadline)
        except futures.TimeoutError:
            raise GcsLost(f"{self.cluster}: its GCS did not answer within {deadline:.0f} s") from None

    def _gcs_down(self) -> bool:
        return self._gcs is not None and not self._gcs.probe()

    def check_cluster(self) -> None:
        """Raise GcsLost once the GCS has refused connections for ``gcs_lost_after_s``: the run
        must end while it still can (Ray ends a driver that cannot reach its GCS for
        RAY_gcs_rpc_server_reconnect_timeout_s, without running any of its clean-up)."""
        if self._gcs is None:
            return
        down = self._gcs.down_for()
        if down >= self._gcs_lost_after_s:
            raise GcsLost(
                f"{self.cluster} is gone: its GCS (on the head node) has refused "
                f"connections for {down:.0f} s, so the head node or its GCS process died, and with it "
                f"this run's workers")

    def create_group(self, size: int, *, timeout_s: float) -> Group:
        ray = self._ray
        from ray.util.placement_group import (  # noqa: PLC0415
            placement_group,
            placement_group_table,
            remove_placement_group,
        )
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415

        gid = f"g{next(_ids)}x{size}"
        asked = time.time()
        pg = placement_group([{"GPU": 1}] * size, strategy="STRICT_PACK")
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            free = int(ray.available_resources().get("GPU", 0))
            raise GroupStartError(
                f"placement group of {size} GPUs on one node was not ready after {timeout_s:.0f} s; "
                f"the cluster has {self.total_gpus()} GPUs, {free} free now (a group needs {size} on ONE "
                f"node; on a shared cluster others may hold them: see --group-start-timeout)"
            ) from None
        # The nodes holding the group, to tell a lost node from a dead worker when a call fails.
        nodes = set(placement_group_table(pg).get("bundles_to_node_id", {}).values())
        progress = _RayProgress(self._progress_actor)
        actors = [
            self._actor_cls.options(
                num_cpus=0, num_gpus=1, name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank),
            ).remote(rank=rank, world_size=size, config=self._config, progress=progress)
            for rank in range(size)
        ]
        group = Group(id=gid, size=size, handle={"pg": pg, "actors": actors, "nodes": nodes}, asked_at=asked)
        with self._lock:
            self._groups[gid] = group
        if size > 1:
            try:
                self._form_process_group(group, timeout_s=timeout_s)
            except Exception as e:
                self.destroy_group(group)
                raise GroupStartError(f"group {gid} of {size} could not form its process group: {e}") from e
        # One GPU: the actor's process is still starting (its first call waits for it); several:
        # every process is up and joined.
        group.placed_at = time.time()
        return group

    def _form_process_group(self, group: Group, *, timeout_s: float) -> None:
        actors = group.handle["actors"]
        r0 = self._ray.get(actors[0].execute.remote(RendezvousCall()), timeout=timeout_s)
        if r0.failure is not None:
            raise RuntimeError(f"rank 0 rendezvous failed: {r0.failure.error}\n{r0.failure.traceback}")
        where = r0.value
        join = InitGroupCall(master_addr=where.addr, master_port=where.port, backend=where.backend)
        replies = self._ray.get([a.execute.remote(join) for a in actors], timeout=timeout_s)
        bad = _first_failure(replies)
        if bad.failure is not None:
            raise RuntimeError(f"rank {bad.rank}: {bad.failure.error}\n{bad.failure.traceback}")

    def destroy_group(self, group: Group) -> None:
        from ray.util.placement_group import remove_placement_group  # noqa: PLC0415

        if self._gcs_down():  # both calls below need the GCS; the cluster's end took the group
            with self._lock:
                self._groups.pop(group.id, None)
            return
        for actor in group.handle["actors"]:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
        try:
            remove_placement_group(group.handle["pg"])
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        with self._lock:
            self._groups.pop(group.id, None)

    def call(self, group: Group, message: WorkerCall, *, timeout_s: float) -> Call:
        # In a group the message (latents, embeddings: MBs) is put in the object store once and
        # every rank reads the same object (a top-level ref argument, so Ray resolves it).
        seq = group.take_seq(message)
        if message.lane is Lane.IO:  # rank 0 alone holds the encode
            refs = [group.handle["actors"][0].execute.options(concurrency_group="io").remote(message)]
        else:
            arg: Any = self._ray.put(message) if group.size > 1 else message
            refs = [a.execute.remote(arg, seq) for a in group.handle["actors"]]
        return Call(group=group, message=message, started=time.monotonic(), timeout_s=timeout_s, handle=refs)

    def wait(self, calls: Sequence[Call], *, timeout_s: float) -> list[Call]:
        ray = self._ray
        refs = [r for c in calls for r in c.handle]
        if not refs:
            return []
        # Return as soon as ANY ref is ready (then sweep up all ready ones), so a finished stage
        # does not wait out the poll interval.
        first, _ = ray.wait(refs, num_returns=1, timeout=timeout_s)
        if not first:
            return []
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        ready_set = set(ready)
        out = []
        for c in calls:
            done = [r in ready_set for r in c.handle]
            if all(done):
                out.append(c)
            elif any(done) and self._any_error(r for r, d in zip(c.handle, done) if d):
                out.append(c)  # one rank died: the others may hang in a collective forever
        return out

    def _any_error(self, refs: Any) -> bool:
        """Did a finished rank fail? Its actor died (get raises) or its call failed: ``execute``
        never raises, so a failed call is a Reply with a failure."""
        for r in refs:
            try:
                if not self._ray.get(r, timeout=0).ok:
                    return True
            except Exception:  # noqa: BLE001
                return True
        return False

    def result(self, call: Call) -> Reply[Any]:
        ray = self._ray
        try:
            replies = ray.get(call.handle, timeout=60)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            # RayError covers the actor dying (ActorDiedError), being OOM-killed by Ray's memory
            # monitor, lost objects; `execute` itself never raises, so any of them means the group.
            # Keep the whole message (capped): for an actor that failed to start, the cause (e.g.
            # an ImportError on that node) is on the lines after the first.
            lost = self._node_lost(call.group)
            where = " (its node left the cluster)" if lost else ""
            raise GroupDied(f"group {call.group.id} failed in {type(call.message).__name__}{where}: "
                            f"{type(e).__name__}: {str(e)[:2000]}",
                            kind=FailureKind.CLUSTER_LOST if lost else classify_group_death(e)) from e
        return _first_failure(replies)

    def _node_lost(self, group: Group) -> bool:
        """Is a node of ``group`` gone from the cluster (or the cluster past asking)? Ray reports
        the actors of a dead node dead only once the GCS has marked the node dead, so by the
        time a call fails for it the node table says so."""
        try:
            alive = {n["NodeID"] for n in self._ask_gcs(self._ray.nodes) if n.get("Alive")}
        except Exception:  # noqa: BLE001 - the GCS cannot be asked: the cluster itself is failing
            return True
        return not group.handle.get("nodes", set()) <= alive

    def progress(self) -> dict[str, StepReport]:
        if self._gcs is not None and self._gcs.down_for() > 0:
            return {}  # its actor may have died with the cluster: Ray would ask the GCS, and block
        try:
            return self._ray.get(self._progress_actor.snapshot.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - progress is cosmetic; never let it stop the batch
            return {}

    def shutdown(self) -> None:
        with self._lock:
            groups = list(self._groups.values())
        for group in groups:
            self.destroy_group(group)
        if not self._gcs_down():
            try:
                self._ray.kill(self._progress_actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        if self._gcs is not None:
            self._gcs.stop()
        self._gcs_queries.shutdown(wait=False, cancel_futures=True)
        if self._owns_ray:
            self._ray.shutdown()


def probe_address(address: str) -> None:
    """Fail in seconds, not minutes (ray.init retries a dead GCS address for a long time), when a
    ``host:port`` or ``ray://host:port`` does not accept connections. ``auto`` is left to Ray."""
    import socket  # noqa: PLC0415

    host, sep, port = address.removeprefix(RAY_CLIENT_SCHEME).rpartition(":")
    if not sep or "://" in host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise ClusterConnectError(
            f"could not join the Ray cluster at {address!r}: nothing answers there ({e}); give the "
            f"head's GCS address (`ray status` on the head node prints it), or omit --address to "
            f"start a local cluster"
        ) from None


# Ray's default for RAY_gcs_rpc_server_reconnect_timeout_s: how long a driver keeps trying to
# reach a GCS that stopped answering before Ray ends the process.
RAY_GCS_RECONNECT_DEFAULT_S = 60.0
# Longest a GCS query (cluster resources, the node table) may take before the GCS counts as
# unreachable; a live GCS answers them in well under a second.
GCS_QUERY_TIMEOUT_S = 10.0


def gcs_lost_after_s() -> float:
    """How long the GCS may refuse connections before the run ends, cluster lost: half of Ray's
    own reconnect timeout, which leaves the other half to put the running jobs back to pending and
    say so. (A GCS with fault tolerance restarts within seconds, and is waited for.)"""
    try:
        ray_s = float(os.environ.get("RAY_gcs_rpc_server_reconnect_timeout_s", RAY_GCS_RECONNECT_DEFAULT_S))
    except ValueError:
        ray_s = RAY_GCS_RECONNECT_DEFAULT_S
    return ray_s / 2


class GcsWatch:
    """Probes, once a second on a daemon thread, that the GCS at ``address`` (host:port) accepts
    a TCP connection. A probe needs nothing from Ray, so it works when every Ray call that needs
    the GCS would block."""

    def __init__(self, address: str, *, period_s: float = 1.0):
        target = self.parse(address)
        if target is None:
            raise ValueError(f"GCS address {address!r} is not HOST:PORT")
        self.address = address
        self._target = target
        self._period_s = period_s
        self._down_since: float | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        threading.Thread(target=self._run, name="gcs-watch", daemon=True).start()

    @staticmethod
    def parse(address: str) -> tuple[str, int] | None:
        """(host, port) of ``HOST:PORT`` or ``[IPv6]:PORT``; None when it is neither."""
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            return None
        return host.removeprefix("[").removesuffix("]"), int(port)

    def probe(self) -> bool:
        """Probe now; True when the GCS accepted the connection."""
        try:
            socket.create_connection(self._target, timeout=self._period_s).close()
            up = True
        except OSError:
            up = False
        with self._lock:
            if up:
                self._down_since = None
            elif self._down_since is None:
                self._down_since = time.monotonic()
        return up

    def down_for(self) -> float:
        """Seconds since the GCS first refused a connection in the current outage (0: it is up)."""
        with self._lock:
            return 0.0 if self._down_since is None else time.monotonic() - self._down_since

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self._period_s):
            self.probe()


class RayWorkerProcess:
    """The Ray actor: a `RenderWorker` built in the actor's own process. The driver creates actors
    of this class without importing the worker (torch), and the actor times that import, which the
    first load reports (``LoadReply.worker``)."""

    def __init__(self, **kwargs: Any):
        t0 = time.perf_counter()
        from pan2render.runner.worker import RenderWorker  # noqa: PLC0415 - torch, in the actor's process

        self._worker = RenderWorker(**kwargs, imports_s=time.perf_counter() - t0)

    def execute(self, call: WorkerCall, seq: int | None = None) -> Reply[Any]:
        """`RenderWorker.execute` (the one entry point)."""
        return self._worker.execute(call, seq)


class _RayProgress:
    """The workers' progress sink: step reports pushed fire-and-forget to the run's StepClock
    actor, which stamps them as they arrive."""

    def __init__(self, actor: Any):
        self._actor = actor

    def report(self, job_id: str, done: int, total: int) -> None:
        self._actor.report.remote(job_id, done, total)


# ====================================================================== pool
class _BackgroundStart:
    """One ``create_group`` running on a daemon thread (daemon: a start stuck waiting for a
    placement group never keeps the process alive after the driver is done)."""

    def __init__(self, size: int, create: Any, destroy: Any) -> None:
        self.size = size
        self.group: Group | None = None
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self._destroy = destroy
        self._lock = threading.Lock()
        self._abandoned = False
        threading.Thread(target=self._run, args=(create,), name=f"group-start-{size}", daemon=True).start()

    def _run(self, create: Any) -> None:
        try:
            group = create()
        except BaseException as e:  # noqa: BLE001 - handed to the driver thread
            self.error = e
        else:
            with self._lock:
                keep = not self._abandoned
                if keep:
                    self.group = group
            if not keep:  # the pool closed while this group was starting
                self._destroy(group)
        self.finished.set()

    def abandon(self) -> None:
        """The pool is closing: whatever this start makes is torn down, now or when it finishes."""
        with self._lock:
            self._abandoned = True
            group, self.group = self.group, None
        if group is not None:
            self._destroy(group)


class GroupPool:
    """Idle groups by size; creates groups while GPUs are free, frees idle ones of other sizes.

    With an executor that ``starts_in_background``, at most one group starts at a time, on a
    thread: ``try_acquire`` returns None while it starts and the group (or its GroupStartError) on
    the first call after. The driver dispatches strictly in order, so that call comes for the same
    job that asked.
    """

    def __init__(self, executor: Executor, *, total_gpus: int, start_timeout_s: float):
        self._ex = executor
        self.total_gpus = total_gpus
        self._start_timeout_s = start_timeout_s
        self._idle: list[Group] = []
        self._busy: dict[str, Group] = {}
        self._starting: _BackgroundStart | None = None
        self.created = 0

    def _used(self) -> int:
        starting = self._starting.size if self._starting is not None else 0
        return sum(g.size for g in self._idle) + sum(g.size for g in self._busy.values()) + starting

    @property
    def starting(self) -> bool:
        return self._starting is not None

    def wait_for_start(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s``, waking early when a background start finishes."""
        if self._starting is not None:
            self._starting.finished.wait(timeout_s)
        else:
            time.sleep(timeout_s)

    def try_acquire(self, size: int) -> Group | None:
        """An idle group of ``size``, a new one, or None when the GPUs are all busy or a group is
        still starting. Raises GroupStartError when a new group cannot form."""
        if self._starting is not None:
            if not self._starting.finished.is_set():
                return None
            self._collect_start()
        for g in self._idle:
            if g.size == size:
                self._idle.remove(g)
                self._busy[g.id] = g
                return g
        free = self.total_gpus - self._used()
        reclaimable = sum(g.size for g in self._idle)
        if free + reclaimable < size:
            return None
        for g in sorted(self._idle, key=lambda g: g.size):  # smallest first: lose fewest models
            if free >= size:
                break
            self._idle.remove(g)
            self._ex.destroy_group(g)
            free += g.size
        if getattr(self._ex, "starts_in_background", False):
            self._starting = _BackgroundStart(
                size, lambda: self._ex.create_group(size, timeout_s=self._start_timeout_s), self._ex.destroy_group)
            return None
        group = self._ex.create_group(size, timeout_s=self._start_timeout_s)
        self.created += 1
        self._busy[group.id] = group
        return group

    def _collect_start(self) -> None:
        """A finished background start: its group joins the idle ones, or its error is raised."""
        start, self._starting = self._starting, None
        if start.error is not None:
            if isinstance(start.error, GroupStartError):
                raise start.error
            raise GroupStartError(f"starting a group of {start.size} failed: "
                                  f"{type(start.error).__name__}: {start.error}") from start.error
        self.created += 1
        self._idle.append(start.group)

    def release(self, group: Group) -> None:
        self._busy.pop(group.id)
        self._idle.append(group)

    def discard(self, group: Group) -> None:
        """Tear a (dead or suspect) group down: actors killed, placement group removed."""
        self._busy.pop(group.id, None)
        if group in self._idle:
            self._idle.remove(group)
        self._ex.destroy_group(group)

    def close(self) -> None:
        if self._starting is not None:
            self._starting.abandon()
            self._starting = None
        for g in list(self._idle) + list(self._busy.values()):
            self.discard(g)
