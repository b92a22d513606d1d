"""A lifecycle as an explicit state machine: an enum of states, an enum of events, and a table
``(state, event) -> next state``. Anything the table does not list is illegal and raises
:class:`IllegalTransition`, naming the state, the event and what that state allows.

A job's (``jobs/ledger.py``, :data:`JOB_TRANSITIONS`) and a farm batch's
(``runner/farm/queue.py``, :data:`BATCH_TRANSITIONS`) are declared this way; their modules hold
the table, this one applies it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)


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
