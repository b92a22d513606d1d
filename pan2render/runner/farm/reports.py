"""The served batches' reports (``DIR/index.html``), written by a child process of the farm.

A report reads a batch's whole ledger and renders a page with a poster per video: ~0.1 s of
Python for a batch of 30 jobs. In the farm's own process that time is taken from the scheduler's
loop (the final report at a batch's end) or from the lock every thread of it shares (the live
updates, on a thread per batch): at a thousand GPUs, a hundred batches at once, that was a fifth of
the loop's time. So one child process writes them all, reading each ledger read-only, as
``pan2-render report`` would; the loop only asks, and looks for the answers on its next pass.

What the user sees is unchanged: a batch's page is brought up to date after its jobs end, at most
every ``min_interval_s``, and a batch ends (in the queue, to `queue` and the API) only once its
final page is written. The live updates give way: they start only while the child has been idle as
long as it last worked (about half of one core at most); a batch's final page goes first.

The child reads one request a line on its stdin and answers one a line on its stdout; it ends when
its stdin closes, so a farm killed with SIGKILL leaves no child behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class _Batch:
    out_dir: Path
    say: Callable[[str], None]
    wanted: int = 0  # bumped by each job end: a write started at a lower count is stale
    written: int = -1  # the count the last finished write started at
    in_flight: int | None = None  # the count the write on its way started at
    last_start: float = float("-inf")
    final_since: float | None = None  # since when the batch has had nothing left to run: its last page is wanted

    @property
    def final(self) -> bool:
        return self.final_since is not None
    path: Path | None = None  # where the last finished write put the page (None: it failed)


@dataclass
class _Child:
    proc: subprocess.Popen[str]
    answers: deque[dict[str, Any]] = field(default_factory=deque)  # filled by its reader thread


class Reports:
    """Each served batch's report, written by one child process (started at the first write)."""

    def __init__(self, *, min_interval_s: float = 5.0, final_wait_s: float = 120.0,
                 wake: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic):
        """``wake``: called from the reader thread when an answer arrives (the idle farm's loop
        waits for requests; a batch waiting for its final page ends on the next pass)."""
        self.min_interval_s = min_interval_s
        self.final_wait_s = final_wait_s
        self.wake = wake
        self.clock = clock
        self.batches: dict[str, _Batch] = {}
        self._child: _Child | None = None
        self._lock = threading.Lock()  # the reader thread's answers
        self._sent: deque[str] = deque()  # batch ids, in the order their requests were sent
        self._last_work_s = 0.0  # how long the child's last write took
        self._idle_since = float("-inf")
        self.writes = 0
        self.child_cpu_s = 0.0  # the child's CPU time, as its last answer said

    # ------------------------------------------------------------------ what the loop asks
    def add(self, batch_id: str, out_dir: Path, *, say: Callable[[str], None]) -> None:
        self.batches[batch_id] = _Batch(Path(out_dir), say)

    def request(self, batch_id: str) -> None:
        """A job of the batch ended: its page is out of date (written again within the interval)."""
        if (b := self.batches.get(batch_id)) is not None:
            b.wanted += 1
            b.final_since = None

    def finish(self, batch_id: str) -> bool:
        """The batch has nothing left to run: True once a page written after its last job ended is
        on disk (or its write failed, said in its log); until then its final write is asked for
        (sent by the next :meth:`poll`)."""
        b = self.batches[batch_id]
        if b.final_since is None:
            b.final_since = self.clock()
        if b.in_flight is None and b.written >= b.wanted:
            return True
        if self.clock() - b.final_since > self.final_wait_s:  # a stuck writer never holds a batch open
            b.say(f"report: the page in {b.out_dir} was not written within {self.final_wait_s:.0f} s; the batch "
                  f"ends without it (`pan2-render report {b.out_dir}` writes it)")
            b.written, b.path = b.wanted, None
            return True
        return False

    def path(self, batch_id: str) -> Path | None:
        return self.batches[batch_id].path

    def remove(self, batch_id: str) -> None:
        self.batches.pop(batch_id, None)

    def poll(self) -> None:
        """Take the child's answers; send the writes that are due (finals first, then live updates
        for which the interval has passed, while the child has rested as long as it last worked)."""
        self._take_answers()
        now = self.clock()
        due = [(not b.final, b.last_start, bid) for bid, b in self.batches.items()
               if b.in_flight is None and b.written < b.wanted
               and (b.final or now - b.last_start >= self.min_interval_s)]
        for not_final, _, bid in sorted(due):
            if not_final and (self._sent or now - self._idle_since < self._last_work_s):
                break
            self._send(bid, now)

    def write_now(self, batch_id: str, timeout_s: float = 60.0) -> Path | None:
        """The batch's final page, waited for (the farm stopping: nothing else to do)."""
        deadline = time.monotonic() + timeout_s
        while not self.finish(batch_id) and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.01)
        return self.batches[batch_id].path

    def close(self) -> None:
        """End the child (its stdin closed: it finishes the write in hand, then exits)."""
        child, self._child = self._child, None
        if child is None:
            return
        try:
            child.proc.stdin.close()  # type: ignore[union-attr]
            child.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            child.proc.kill()
            child.proc.wait()

    # ------------------------------------------------------------------ the child
    def _send(self, batch_id: str, now: float) -> None:
        b = self.batches[batch_id]
        child = self._started()
        b.in_flight, b.last_start = b.wanted, now
        self._sent.append(batch_id)
        try:
            child.proc.stdin.write(json.dumps({"out_dir": str(b.out_dir)}) + "\n")  # type: ignore[union-attr]
            child.proc.stdin.flush()  # type: ignore[union-attr]
        except OSError as e:  # the child is gone: a new one starts with the next write
            self._lost(f"the report writer exited: {e}")

    def _started(self) -> _Child:
        if self._child is None:
            proc = subprocess.Popen([sys.executable, "-m", "pan2render.runner.farm.reports"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, bufsize=1)
            self._child = _Child(proc)
            threading.Thread(target=self._read, args=(self._child,), name="report-writer", daemon=True).start()
        return self._child

    def _read(self, child: _Child) -> None:
        for line in child.proc.stdout:  # type: ignore[union-attr]
            with self._lock:
                child.answers.append(json.loads(line))
            self.wake()
        with self._lock:
            child.answers.append({"exited": child.proc.wait()})
        self.wake()

    def _lost(self, why: str) -> None:
        """The child is gone: every write sent to it failed (said in its batch's log, a batch's
        final page then counting as written: a report is never worth a batch)."""
        self._child = None
        for bid in self._sent:
            if (b := self.batches.get(bid)) is not None:
                b.say(f"report: could not write the page in {b.out_dir} ({why})")
                b.written, b.in_flight, b.path = b.in_flight or 0, None, None
        self._sent.clear()

    def _take_answers(self) -> None:
        child = self._child
        if child is None:
            return
        with self._lock:
            answers = list(child.answers)
            child.answers.clear()
        for answer in answers:
            if "exited" in answer:
                self._lost(f"the report writer exited with {answer['exited']}")
                return
            bid = self._sent.popleft()
            self.writes += 1
            self._last_work_s, self.child_cpu_s = answer["seconds"], answer["cpu_s"]
            self._idle_since = self.clock()
            if (b := self.batches.get(bid)) is None:
                continue
            for text in answer["said"]:
                b.say(text)
            b.written, b.in_flight = b.in_flight or 0, None
            b.path = Path(answer["path"]) if answer["path"] else None


def serve_requests() -> None:
    """The child: one ``{"out_dir": ...}`` a line in, one ``{"path", "said", "seconds", "cpu_s"}``
    a line out, until stdin closes. A failed write is said in ``said`` (a report is never worth a
    batch), with ``path`` null."""
    from pan2render.runner.views.report import REPORT_NAME, write_report

    for line in sys.stdin:
        out_dir = Path(json.loads(line)["out_dir"])
        said: list[str] = []
        t = time.perf_counter()
        try:
            path: str | None = str(write_report(out_dir, say=said.append))
        except Exception as e:
            said.append(f"report: could not write {out_dir / REPORT_NAME}: {type(e).__name__}: {e}")
            path = None
        print(json.dumps({"path": path, "said": said, "seconds": time.perf_counter() - t,
                          "cpu_s": time.process_time()}), flush=True)


if __name__ == "__main__":
    serve_requests()
