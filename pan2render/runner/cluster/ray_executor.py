"""Groups of Ray actors: the executor interface on a Ray cluster.

One actor per GPU, the group's actors in one STRICT_PACK placement group, joined into a
torch.distributed group (NCCL on GPUs, gloo on CPU) with the rendezvous on rank 0's node.

The executor also watches its cluster. A call that fails because its group's node left the
cluster says so (its GroupDied's kind is cluster-lost): the failure is the cluster's, not the
job's. And a GCS that stops accepting connections is noticed by probing its port
(``cluster.GcsWatch``), since Ray's own calls that need the GCS then block until Ray ends the
driver: ``check_cluster`` raises ``GcsLost`` before that, while the driver can still put its jobs
back and say so.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

from pan2render.runner.cluster.executor import Call, Group, GroupDied, GroupStartError, first_failure, next_group_number
from pan2render.runner.cluster.leftovers import forget, record_cluster
from pan2render.runner.cluster.node import NodeError, end_processes, process_tree
from pan2render.runner.cluster.ray_actors import RayProgress, RayWorkerProcess, interrupts_deferred, own_children
from pan2render.runner.cluster.ray_cluster import (
    GCS_QUERY_TIMEOUT_S,
    RAY_CLIENT_SCHEME,
    ClusterConnectError,
    GcsLost,
    GcsWatch,
    check_loopback,
    gcs_lost_after_s,
    loopback_only,
    parse_gcs_address,
    probe_address,
    write_ray_token_if_missing,
)
from pan2render.runner.protocol.failures import FailureKind, classify_group_death
from pan2render.runner.protocol.messages import (
    GPU_QUEUE_DEPTH,
    IO_CONCURRENCY,
    InitGroupCall,
    Lane,
    RendezvousCall,
    Reply,
    WorkerCall,
    WorkerConfig,
)
from pan2render.runner.protocol.steps import StepClock, StepReport

WAIT_NOTE_EVERY_S = 10.0  # how often a group waiting for GPUs says so
NODE_LEFTOVERS_GRACE_S = 3.0  # after ray.shutdown(): what is left of our node's processes, SIGTERM to SIGKILL


class RayExecutor:
    """Groups of Ray actors. ``address=None`` starts a local cluster with ``gpus`` logical GPUs.

    ``create_group`` may run on the pool's start thread while the driver thread calls the rest
    (Ray's API is thread-safe); ``_groups`` is shared between them under ``_lock``.
    """

    starts_in_background = True

    def __init__(self, *, address: str | None, gpus: int | None, cpus: int | None,
                 config: WorkerConfig, object_store_bytes: int = 1 << 30, local_node: bool = False,
                 record: Path | None = None, started_by: str = "run"):
        """``local_node``: ``address`` is the node kept up on this machine (`running_local_node`);
        ``record``: where a local cluster started here records its processes (`cluster/leftovers.py`),
        dropped when it ends; ``started_by``: what starts a local cluster here, as it is named ("the
        local Ray cluster this farm started")."""
        self._started_by = started_by
        with loopback_only() if address is None else contextlib.nullcontext():
            import ray  # importing ray costs ~1 s; unit tests with LocalExecutor skip it

        self._ray = ray
        self._config = config
        # Already connected (a test's module-wide cluster, or an embedding application): use that
        # cluster as it is and leave it running at shutdown.
        self._owns_ray = not ray.is_initialized()
        self._node_roots: set[int] = set()  # the processes ray.init started here for a local cluster
        self._record: Path | None = None  # where they are recorded, once they are
        try:
            self._start(address=address, gpus=gpus, cpus=cpus, object_store_bytes=object_store_bytes,
                        local_node=local_node, record=record)
        except BaseException:
            # Interrupted (Ctrl-C, a stop signal, or Ray's own SIGTERM handler's SystemExit) or
            # failed while starting or joining Ray: what was started ends with the run.
            self._end_ray()
            raise

    def _start(self, *, address: str | None, gpus: int | None, cpus: int | None, object_store_bytes: int,
               local_node: bool, record: Path | None) -> None:
        ray = self._ray
        # Where Ray keeps the workers' own logs (this node's session folder), when we started or
        # joined Ray here; a Ray client (ray://) keeps them on the cluster's nodes.
        self.worker_logs: str | None = None
        context: Any = None
        if self._owns_ray and address is None:
            # A local cluster: no dashboard (slow to start, not needed), a modest object store
            # (artifacts are MBs: latents ~10 MB, an mp4 a few MB), worker logs shown here.
            # "local": a new cluster even where a node recorded on this machine is gone. It listens
            # on the loopback address alone (loopback_only) and its token file is its owner's.
            write_ray_token_if_missing()
            before = own_children()
            try:
                with interrupts_deferred():
                    context = ray.init(address="local", num_cpus=cpus, num_gpus=gpus, include_dashboard=False,
                                       log_to_driver=True, object_store_memory=object_store_bytes,
                                       logging_level="WARNING")
            finally:  # the GCS, raylet, ... of the new node: this process's children since ray.init
                self._node_roots = own_children() - before
            check_loopback(context.address_info["node_ip_address"])
            if record is not None:  # for the next start to end, should this process be killed
                self._record = record
                try:
                    record_cluster(record, session_dir=context.address_info["session_dir"],
                                   pids=self._node_processes())
                except OSError as e:  # the run goes on; only a kill would leave its agents running
                    print(f"warning: the local Ray cluster's processes could not be recorded in {record} ({e}): "
                          f"should this process be killed, its Ray agents would run on for minutes",
                          file=sys.stderr, flush=True)
        elif self._owns_ray:
            probe_address(address)
            try:
                # The node kept up here is joined as Ray's "auto" finds it, the one way Ray takes its
                # token (token authentication, on by default) from ~/.ray without being told to.
                with interrupts_deferred():
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
        self.gcs_address: str | None = None  # host:port of the cluster's GCS (None: a Ray client)
        self.cluster = f"the Ray cluster at {address}"
        gcs_address = None if (address or "").startswith(RAY_CLIENT_SCHEME) else \
            ray.get_runtime_context().gcs_address
        if gcs_address and parse_gcs_address(gcs_address) is not None:
            self._gcs = GcsWatch(gcs_address)
            self.gcs_address = gcs_address
            self.cluster = (f"the Ray node running on this machine (GCS at {gcs_address})" if local_node
                            else f"the Ray cluster at {gcs_address}" if address is not None or not self._owns_ray
                            else f"the local Ray cluster this {self._started_by} started (GCS at {gcs_address})")
        self._gcs_lost_after_s = gcs_lost_after_s()
        # GCS queries run here, each with a deadline: one that would block (the GCS died after the
        # last probe) leaves its thread stuck instead of the driver's loop.
        self._gcs_queries = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="gcs-query")
        # Two lanes per actor (worker/render_worker.py): the default group runs the GPU lane with one thread per
        # call the driver may queue (the worker orders them by seq), "io" runs the I/O lane.
        self._actor_cls = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=GPU_QUEUE_DEPTH,
                                     concurrency_groups={"io": IO_CONCURRENCY})(RayWorkerProcess)
        self._progress_actor = ray.remote(StepClock).options(num_cpus=0).remote()
        self._groups: dict[str, Group] = {}
        self._lock = threading.Lock()

    def total_gpus(self) -> int:
        return int(self._ask_gcs(self._ray.cluster_resources).get("GPU", 0))

    def free_gpus(self) -> int:
        return int(self._ask_gcs(self._ray.available_resources).get("GPU", 0))

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

    def unreachable(self) -> str | None:
        """A TCP probe of the GCS, which needs nothing of Ray (so it never blocks on a cluster gone);
        a Ray client (no GCS address) answers while its connection is up."""
        if self._gcs is not None:
            return None if self._gcs.probe() else f"{self.cluster}: its GCS refuses connections"
        return None if self._ray.is_initialized() else f"{self.cluster}: Ray is not connected"

    def create_group(self, size: int, *, timeout_s: float, on_wait: Callable[[str], None] | None = None) -> Group:
        ray = self._ray
        from ray.util.placement_group import (
            placement_group,
            placement_group_table,
            remove_placement_group,
        )

        gid = f"g{next_group_number()}x{size}"
        asked = time.time()
        pg = placement_group([{"GPU": 1}] * size, strategy="STRICT_PACK")
        ready = pg.ready()
        while not ray.wait([ready], timeout=min(WAIT_NOTE_EVERY_S, max(asked + timeout_s - time.time(), 0)))[0]:
            waited = time.time() - asked
            if waited >= timeout_s:
                remove_placement_group(pg)
                raise GroupStartError(
                    f"placement group of {size} GPUs on one node was not ready after {timeout_s:.0f} s; "
                    f"the cluster has {self.total_gpus()} GPUs, {self.free_gpus()} free now (a group needs {size} "
                    f"on ONE node; on a shared cluster others may hold them: see --group-start-timeout)"
                ) from None
            if on_wait is not None:
                on_wait(f"group {gid}: waiting for {size} GPU(s) on one node: the cluster has {self.free_gpus()} "
                        f"free of {self.total_gpus()} (other groups or applications hold the rest); waited "
                        f"{waited:.0f} s of --group-start-timeout {timeout_s:.0f} s")
        # The nodes holding the group, to tell a lost node from a dead worker when a call fails.
        nodes = set(placement_group_table(pg).get("bundles_to_node_id", {}).values())
        return self._start_workers(Group(id=gid, size=size, handle={"pg": pg, "nodes": nodes}, asked_at=asked),
                                   timeout_s=timeout_s)

    def _start_workers(self, group: Group, *, timeout_s: float) -> Group:
        """One actor per bundle of the group's placement group, joined into a process group."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        progress = RayProgress(self._progress_actor)
        group.handle["actors"] = [
            self._actor_cls.options(
                num_cpus=0, num_gpus=1, name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group.handle["pg"], placement_group_bundle_index=rank),
            ).remote(rank=rank, world_size=group.size, config=self._config, progress=progress)
            for rank in range(group.size)
        ]
        with self._lock:
            self._groups[group.id] = group
        if group.size > 1:
            try:
                self._form_process_group(group, timeout_s=timeout_s)
            except Exception as e:
                self.destroy_group(group)
                raise GroupStartError(f"group {group.id} of {group.size} could not form its process group: "
                                      f"{e}") from e
        # One GPU: the actor's process is still starting (its first call waits for it); several:
        # every process is up and joined.
        group.placed_at = time.time()
        return group

    def restart_group(self, group: Group, *, timeout_s: float) -> Group:
        """New actors in the group's placement group: the same GPUs, a fresh process (a sticky CUDA
        error ends with the old one)."""
        self._kill_actors(group)
        fresh = Group(id=group.id, size=group.size, handle={"pg": group.handle["pg"], "nodes": group.handle["nodes"]},
                      asked_at=time.time(), faults=group.faults)
        return self._start_workers(fresh, timeout_s=timeout_s)

    def hold_out(self, group: Group) -> None:
        """The actors end; the placement group stays, so Ray places nothing else on its GPUs."""
        self._kill_actors(group)

    def _form_process_group(self, group: Group, *, timeout_s: float) -> None:
        actors = group.handle["actors"]
        r0 = self._ray.get(actors[0].execute.remote(RendezvousCall()), timeout=timeout_s)
        if r0.failure is not None:
            raise RuntimeError(f"rank 0 rendezvous failed: {r0.failure.error}\n{r0.failure.traceback}")
        where = r0.value
        join = InitGroupCall(init_method=where.init_method, backend=where.backend)
        replies = self._ray.get([a.execute.remote(join) for a in actors], timeout=timeout_s)
        bad = first_failure(replies)
        if bad.failure is not None:
            raise RuntimeError(f"rank {bad.rank}: {bad.failure.error}\n{bad.failure.traceback}")

    def destroy_group(self, group: Group) -> None:
        from ray.util.placement_group import remove_placement_group

        if self._gcs_down():  # both calls below need the GCS; the cluster's end took the group
            with self._lock:
                self._groups.pop(group.id, None)
            return
        self._kill_actors(group)
        try:
            remove_placement_group(group.handle["pg"])
        except Exception:
            traceback.print_exc()
        with self._lock:
            self._groups.pop(group.id, None)

    def _kill_actors(self, group: Group) -> None:
        for actor in group.handle.get("actors", ()):
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # already dead is fine
                pass

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
            except Exception:
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
            node_lost = self._node_lost(call.group)
            lost = node_lost or self.lacks_gpus_for(call.group.size)
            where = (" (its node left the cluster)" if node_lost
                     else " (the cluster lost the GPUs it needs)" if lost else "")
            raise GroupDied(f"group {call.group.id} failed in {type(call.message).__name__}{where}: "
                            f"{type(e).__name__}: {str(e)[:2000]}",
                            kind=FailureKind.CLUSTER_LOST if lost else classify_group_death(e)) from e
        return first_failure(replies)

    def _node_lost(self, group: Group) -> bool:
        """Is a node of ``group`` gone from the cluster (or the cluster past asking)? Ray reports
        the actors of a dead node dead only once the GCS has marked the node dead, so by the
        time a call fails for it the node table says so."""
        try:
            alive = {n["NodeID"] for n in self._ask_gcs(self._ray.nodes) if n.get("Alive")}
        except Exception:  # the GCS cannot be asked: the cluster itself is failing
            return True
        return not group.handle.get("nodes", set()) <= alive

    def lacks_gpus_for(self, size: int) -> bool:
        try:
            return self.total_gpus() < size
        except Exception:  # the cluster cannot even be asked: it is gone
            return True

    def progress(self) -> dict[str, StepReport]:
        if self._gcs is not None and self._gcs.down_for() > 0:
            return {}  # its actor may have died with the cluster: Ray would ask the GCS, and block
        try:
            return self._ray.get(self._progress_actor.snapshot.remote(), timeout=10)
        except Exception:  # progress is cosmetic; never let it stop the batch
            return {}

    def shutdown(self) -> None:
        with self._lock:
            groups = list(self._groups.values())
        for group in groups:
            self.destroy_group(group)
        if not self._gcs_down():
            try:
                self._ray.kill(self._progress_actor, no_restart=True)
            except Exception:
                pass
        if self._gcs is not None:
            self._gcs.stop()
        self._gcs_queries.shutdown(wait=False, cancel_futures=True)
        self._end_ray()

    def _end_ray(self) -> None:
        """``ray.shutdown()`` of a Ray this run owns, then an end to what its local node left running.

        Ray ends only a node it has finished starting: a driver interrupted while ray.init waits
        for the new raylet to register leaves the raylet's dashboard and runtime-env agents
        running for a minute (the GCS and raylet die with the driver; the agents notice only
        later). So the processes ray.init started here, and their descendants, are listed before
        the shutdown (which orphans the raylet's children) and any still running after it get a
        SIGTERM, then a SIGKILL. Only a local cluster of this run's own: a joined cluster has no
        processes started here."""
        if not self._owns_ray:
            return
        ours = self._node_processes()
        try:
            self._ray.shutdown()
        finally:
            end_processes(ours, grace_s=NODE_LEFTOVERS_GRACE_S)
            forget(self._record)

    def _node_processes(self) -> set[int]:
        """The processes of the local node this run started, now: those ray.init started that are
        still our children (a pid reused since is not), and their descendants."""
        try:
            return process_tree(self._node_roots & own_children())
        except NodeError:  # no /proc: Ray's own shutdown is all there is
            return set()
