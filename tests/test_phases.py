"""Named, timed steps (pan2render.phases): kept only while recording, flat, in order."""

from __future__ import annotations

import threading

from pan2render.phases import Phase, describe, phase, recording


def test_outside_a_recording_a_phase_keeps_nothing_and_syncs_nothing() -> None:
    synced: list[int] = []
    with phase("DiT", sync=lambda: synced.append(1)):
        pass
    assert synced == []
    with recording() as record:
        pass
    assert record.phases == []


def test_phases_are_flat_in_order_and_merge_when_repeated() -> None:
    synced: list[str] = []
    with recording() as record:
        with phase("imports"):
            pass
        with phase("imports"):  # the same step timed in two places: listed once
            pass
        with phase("DiT", sync=lambda: synced.append("DiT")):
            with phase("inner"):  # part of DiT, not listed
                pass
        with phase("VAE"):
            pass
    assert [p.name for p in record.phases] == ["imports", "DiT", "VAE"]
    assert all(p.seconds >= 0 for p in record.phases) and synced == ["DiT"]


def test_a_recording_sees_its_own_thread_only() -> None:
    def elsewhere() -> None:
        with phase("elsewhere"):
            pass

    with recording() as record:
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
        with phase("here"):
            pass
    assert [p.name for p in record.phases] == ["here"]


def test_describe_adds_what_no_phase_covered() -> None:
    phases = [Phase("imports", 2.14), Phase("DiT", 6.3)]
    assert describe(phases) == "imports 2.1 s, DiT 6.3 s"
    assert describe(phases, total=9.0) == "imports 2.1 s, DiT 6.3 s, other 0.6 s"
    assert describe(phases, total=8.46) == "imports 2.1 s, DiT 6.3 s"  # under 0.05 s left: not listed
