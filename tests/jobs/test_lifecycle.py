"""The state-machine helper: a table applied, and an illegal event named with what is allowed."""

from __future__ import annotations

import enum

import pytest

from pan2render.jobs.lifecycle import IllegalTransition, Lifecycle, Transition, transition_table


class Door(str, enum.Enum):
    OPEN = "open"
    SHUT = "shut"
    GONE = "gone"


class Push(Transition):
    OPEN = "open", {Door.SHUT}, Door.OPEN
    SHUT = "shut", {Door.OPEN}, Door.SHUT
    LOCK = "lock", (), Door.SHUT  # declared, allowed from nowhere
    BURN = "burn", {Door.OPEN, Door.SHUT}, Door.GONE


DOOR = Lifecycle("door", transition_table(Push))


def test_the_table_is_what_each_event_declares() -> None:
    assert DOOR.transitions == {(Door.SHUT, Push.OPEN): Door.OPEN, (Door.OPEN, Push.SHUT): Door.SHUT,
                                (Door.OPEN, Push.BURN): Door.GONE, (Door.SHUT, Push.BURN): Door.GONE}
    assert DOOR.next(Door.SHUT, Push.OPEN) is Door.OPEN
    assert DOOR.next(Door.OPEN, Push.BURN) is Door.GONE
    # A member is its string, as a plain (str, Enum) member: stored, looked up and compared by it.
    assert Push("burn") is Push.BURN and Push.BURN == "burn" and Push.BURN.value == "burn"


def test_an_unlisted_event_names_the_state_the_event_and_what_is_allowed() -> None:
    with pytest.raises(IllegalTransition) as err:
        DOOR.next(Door.OPEN, Push.LOCK)
    print(err.value)
    assert str(err.value) == "door state 'open' has no transition 'lock'; allowed from 'open': ['burn', 'shut']"
    assert (err.value.state, err.value.event, err.value.allowed) == (Door.OPEN, Push.LOCK, [Push.BURN, Push.SHUT])
    with pytest.raises(IllegalTransition, match="allowed from 'gone': none \\(terminal\\)"):
        DOOR.next(Door.GONE, Push.OPEN)
