"""`queue` without --all lists every batch not ended, a paused one included (paused is not ended:
it is waiting for its owner); --all adds the ended ones."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from runner_helpers import serving_farm, submit_file

from pan2render.client import FarmClient
from pan2render.runner.cli import batches
from pan2render.runner.cli import main as cli


def test_bare_queue_shows_a_paused_batch_and_hides_an_ended_one(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    with serving_farm(tmp_path) as (farm, url, token):
        client = FarmClient(url, token)
        monkeypatch.setattr(batches, "farm_client", lambda root: client)
        ended = submit_file(farm, tmp_path / "ended", {"jobs": [{"name": "a", "prompt": "a"}]})
        deadline = time.monotonic() + 60
        while client.get(f"/api/batches/{ended}")["state"] != "done":
            assert time.monotonic() < deadline, "the first batch did not end"
            time.sleep(0.05)
        paused = submit_file(farm, tmp_path / "paused", {"jobs": [{"name": "b", "prompt": "b"}]}, paused=True)
        # (the farm publishes its snapshot before it answers a request: the pause is in it)
        assert cli.main(["queue"]) == cli.EXIT_OK
        shown = capsys.readouterr().out
        assert cli.main(["queue", "--all"]) == cli.EXIT_OK
        every = capsys.readouterr().out
    print(shown)
    rows = {line.split()[0]: line for line in shown.splitlines()[1:] if line.strip()}
    assert paused in rows and "paused" in rows[paused]
    assert ended not in rows
    assert {paused, ended} <= {line.split()[0] for line in every.splitlines()[1:] if line.strip()}
