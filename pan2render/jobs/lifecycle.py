"""A lifecycle as an explicit state machine: an enum of states, an enum of events, and a table
``(state, event) -> next state``. Anything the table does not list is illegal and raises
:class:`IllegalTransition`, naming the state, the event and what that state allows.

Each event declares its rule where it is named (:class:`Transition`: the states it leaves, the
one it enters), and the table is derived from them (:func:`transition_table`), so a new event is
one line. A job's (``jobs/ledger.py``, :data:`JOB_TRANSITIONS`) and a farm batch's
(``runner/farm/queue.py``, :data:`BATCH_TRANSITIONS`) are declared this way.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)
T = TypeVar("T", bound="Transition")


class Transition(str, enum.Enum):
    """An event of a lifecycle, each member declaring the states it leaves and the one it enters:
    ``START = "start", {State.PENDING}, State.RUNNING``. A member's value is the string alone: it
    is stored, compared and printed as a plain ``(str, Enum)`` member is."""

    sources: frozenset[enum.Enum]  # the states it leaves
    target: enum.Enum  # the state it enters

    def __new__(cls, value: str, sources: Iterable[enum.Enum], target: enum.Enum) -> Transition:
        member = str.__new__(cls, value)
        member._value_ = value
        member.sources = frozenset(sources)
        member.target = target
        return member


def transition_table(events: Iterable[T]) -> dict[tuple[Any, T], Any]:
    """``(from, event) -> to`` for each event and each state it leaves, in the events' order."""
    return {(s, e): e.target for e in events for s in sorted(e.sources, key=lambda s: str(s.value))}


class IllegalTransition(RuntimeError):
    """An event the table does not allow from a state; ``allowed``: the events that state has."""

    def __init__(self, subject: str, state: enum.Enum, event: enum.Enum, allowed: Sequence[enum.Enum]):
        self.state = state
        self.event = event
        self.allowed = allowed
        names = [e.value for e in allowed]
        super().__init__(f"{subject} state {state.value!r} has no transition {event.value!r}; allowed from "
                         f"{state.value!r}: {names or 'none (terminal)'}")


@dataclass(frozen=True)
class Lifecycle(Generic[S, E]):
    subject: str  # what goes through it, as an error names it ("job", "batch")
    transitions: Mapping[tuple[S, E], S]  # (from, event) -> to; anything not listed raises

    def next(self, state: S, event: E) -> S:
        """The state ``event`` takes ``state`` to; IllegalTransition if the table has none."""
        try:
            return self.transitions[(state, event)]
        except KeyError:
            raise IllegalTransition(self.subject, state, event, self.allowed(state)) from None

    def allowed(self, state: S) -> list[E]:
        """The events that leave ``state``, by value (empty: a terminal state)."""
        return sorted((e for (s, e) in self.transitions if s == state), key=lambda e: str(e.value))
