"""A rank's sequences of calls: the key that matches each call with its peers' (the
collectives' count, or a (sender, receiver) pair's), and the signal base each call is
issued with (past every value of the calls of its sequence before it)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from ..sched.plan import Plan

__all__ = ["Sequences"]


class Sequences:
    """The collectives' and each pair's count of calls, and their signal values so far."""

    def __init__(self) -> None:
        self._collectives = 0           # collectives enqueued (the matching key)
        self._pair_calls: Dict[Tuple[int, ...], int] = {}
        self._signal_base = 0
        self._pair_base: Dict[Tuple[int, ...], int] = {}

    def key(self, plan: Plan) -> tuple:
        """The key of the next call of ``plan``'s sequence, which matches it across ranks:
        ("coll", n) or ("pair", sender, receiver, n)."""
        if plan.pair:
            return ("pair",) + plan.pair + (self._pair_calls.get(plan.pair, 0),)
        return ("coll", self._collectives)

    def made(self) -> Tuple[int, Dict[Tuple[int, ...], int]]:
        """Collectives made, and calls per (sender, receiver) pair."""
        return self._collectives, dict(self._pair_calls)

    def skip(self, pair: Optional[Tuple[int, int]]) -> tuple:
        """The key of the next collective, or the next of ``pair``, advancing its sequence
        as if the call had been made."""
        if pair:
            key: tuple = ("pair",) + tuple(pair) + (self._pair_calls.get(pair, 0),)
            self._pair_calls[pair] = key[-1] + 1
        else:
            key = ("coll", self._collectives)
            self._collectives += 1
        return key

    def count(self, plan: Plan, key: tuple) -> None:
        """Advance the sequence ``key`` (of a call of ``plan``) was taken from."""
        if plan.pair:
            self._pair_calls[plan.pair] = key[-1] + 1
        else:
            self._collectives += 1

    def base(self, plan: Plan) -> int:
        """The signal base of the next call of ``plan``'s sequence (the collectives', or its
        pair's in one direction): its values so far; the next call starts past its values."""
        if plan.pair:
            base = self._pair_base.get(plan.pair, 0)
            self._pair_base[plan.pair] = base + plan.max_value
        else:
            base = self._signal_base
            self._signal_base += plan.max_value
        return base
