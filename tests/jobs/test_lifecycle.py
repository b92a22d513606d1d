"""The state-machine helper: a table applied, and an illegal event named with what is allowed."""

from __future__ import annotations

import enum

import pytest

from pan2render.jobs.lifecycle import IllegalTransition, Lifecycle


class Door(str, enum.Enum):
    OPEN = "open"
    SHUT = "shut"
    GONE = "gone"


class Push(str, enum.Enum):
    OPEN = "open"
    SHUT = "shut"
    LOCK = "lock"
    BURN = "burn"


DOOR = Lifecycle("door", {(Door.SHUT, Push.OPEN): Door.OPEN, (Door.OPEN, Push.SHUT): Door.SHUT,
                          (Door.SHUT, Push.BURN): Door.GONE, (Door.OPEN, Push.BURN): Door.GONE})


def test_a_listed_event_moves_the_state() -> None:
    assert DOOR.next(Door.SHUT, Push.OPEN) is Door.OPEN
    assert DOOR.next(Door.OPEN, Push.BURN) is Door.GONE


def test_an_unlisted_event_names_the_state_the_event_and_what_is_allowed() -> None:
    with pytest.raises(IllegalTransition) as err:
        DOOR.next(Door.OPEN, Push.LOCK)
    print(err.value)
    assert str(err.value) == "door state 'open' has no transition 'lock'; allowed from 'open': ['burn', 'shut']"
    assert (err.value.state, err.value.event, err.value.allowed) == (Door.OPEN, Push.LOCK, [Push.BURN, Push.SHUT])
    with pytest.raises(IllegalTransition, match="allowed from 'gone': none \\(terminal\\)"):
        DOOR.next(Door.GONE, Push.OPEN)
