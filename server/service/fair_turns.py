"""Fair turns among lanes (deficit round robin): the one rule by which the service shares its
work between runs, in the one queue every run's jobs wait in (``scheduler``).

A lane is a run's id on a server of many runs, "" on a server of one. Items of one lane are
taken in the order they were put; lanes with work take turns, one item each, weighted: a lane of
weight 2 gives two items a turn, one of weight 0.5 one item every other turn. A lane that floods
the queue therefore delays another lane's next item by at most one item of each other lane with
work (times its weight), and with one lane the queue is first in, first out.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

MIN_WEIGHT = 0.01  # the lightest share: one item every hundred turns


class FairTurns(Generic[T]):
    """Lanes of items in the order they were put, served in turns by weight.

    ``weight_of(lane)`` is read when a lane's turn begins (default 1.0 for every lane). Not
    thread-safe: its owner holds a lock around every call.
    """

    def __init__(self, weight_of: Callable[[str], float] | None = None) -> None:
        self.weight_of = weight_of or (lambda lane: 1.0)
        self._lanes: dict[str, deque[T]] = {}
        self._turns: deque[str] = deque()  # lanes with work; the first one's turn is now
        self._credit: dict[str, float] = {}  # items a lane may still give in its turn

    def __bool__(self) -> bool:
        return bool(self._turns)

    def _weight(self, lane: str) -> float:
        """``weight_of(lane)``, at least ``MIN_WEIGHT`` (a lane always gets its turn at last);
        1.0 when it fails: a weight is a share, never a reason for the owner to stop."""
        try:
            return max(float(self.weight_of(lane)), MIN_WEIGHT)
        except Exception:
            logger.exception("the weight of lane %r could not be read: 1.0", lane)
            return 1.0

    def heads(self) -> Iterator[T]:
        """The first item of each lane with work (the oldest of all is one of them)."""
        return (items[0] for items in self._lanes.values())

    def head_of(self, lane: str) -> T | None:
        """The first item of ``lane`` (None: it has none)."""
        items = self._lanes.get(lane)
        return items[0] if items else None

    def put(self, lane: str, item: T) -> None:
        if lane not in self._lanes:
            self._lanes[lane] = deque()
            self._turns.append(lane)
            self._credit[lane] = 0.0
        self._lanes[lane].append(item)

    def peek(self) -> tuple[str, T] | None:
        """The lane whose turn it is and the item ``take`` returns next (None: nothing is
        queued). Putting more in between does not change it: a new lane queues at the back."""
        while self._turns:
            lane = self._turns[0]
            if self._credit[lane] >= 1.0:
                return lane, self._lanes[lane][0]
            self._credit[lane] += self._weight(lane)
            if self._credit[lane] < 1.0:  # a light lane saves up over turns
                self._turns.rotate(-1)
        return None

    def take(self) -> T | None:
        """The next item: the first lane's, once it has the credit for it (a turn adds its
        weight); a lane whose turn is spent goes to the back, one left empty leaves."""
        peeked = self.peek()
        if peeked is None:
            return None
        lane, _ = peeked
        item = self._lanes[lane].popleft()
        self._credit[lane] -= 1.0
        if not self._leave_if_empty(lane) and self._credit[lane] < 1.0:
            self._turns.rotate(-1)
        return item

    def take_more(self, lane: str, fits: Callable[[T], bool], limit: int) -> list[T]:
        """Up to ``limit`` more items at the head of ``lane`` while they ``fits``, in the same
        turn as the item just taken from it (its owner runs them as one: a batch)."""
        items = self._lanes.get(lane)
        taken: list[T] = []
        while items and len(taken) < limit and fits(items[0]):
            taken.append(items.popleft())
        self._leave_if_empty(lane)
        return taken

    def lane_heads(self) -> list[tuple[str, T]]:
        """Each lane with work and its first item, in the order of their turns."""
        return [(lane, self._lanes[lane][0]) for lane in self._turns]

    def heads_after(self, lane: str) -> list[tuple[str, T]]:
        """The first item of each lane with work but ``lane``, in the order of their turns
        from ``lane``'s (the order ``take_out_of_turn`` takes them in for one batch)."""
        heads = self.lane_heads()
        at = next((i for i, (other, _) in enumerate(heads) if other == lane), None)
        return heads if at is None else heads[at + 1 :] + heads[:at]

    def take_out_of_turn(self, lane: str) -> T:
        """The first item of ``lane``, taken before its turn (it runs in one batch with the
        item whose turn it is): it spends ``lane``'s next turn, so a lane gives no more items
        than its turns whether its items run alone or in batches. A lane left empty leaves
        (its spent turn with it: it had nothing more to give in it)."""
        item = self._lanes[lane].popleft()
        self._credit[lane] -= 1.0
        self._leave_if_empty(lane)
        return item

    def _leave_if_empty(self, lane: str) -> bool:
        """A lane left without items leaves the turns (its unspent credit with it)."""
        if lane not in self._lanes or self._lanes[lane]:
            return False
        del self._lanes[lane], self._credit[lane]
        self._turns.remove(lane)
        return True
