"""A receiver's table of known producers: least recently used first, bounded fairly across principals.

Keys are receivers.principal.producer_key: an authenticated principal's ids are "\\0<principal>\\0<id>",
an anonymous server's the id itself. Past the bound the table forgets producers, and a forgotten
producer's resend is taken again (its dedup state is gone). With one LRU order for everyone, one
principal opening many sessions with fresh ids pushed every other principal's producers out. So the
table forgets the least recently used producer of the principal holding the most entries: a flood
evicts its own, and a server without authentication (one principal) is plain LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

S = TypeVar("S")


def principal_of(key: str) -> str:
    """The principal a producer key belongs to ("" for an anonymous server's ids, which hold no NUL)."""
    if not key.startswith("\0"):
        return ""
    end = key.find("\0", 1)
    return key[1:end] if end > 0 else ""


class ProducerTable(Generic[S]):
    def __init__(self) -> None:
        self._states: OrderedDict[str, S] = OrderedDict()  # least recently used first
        self._by_principal: dict[str, OrderedDict[str, None]] = {}  # the same order, per principal

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __contains__(self, key: object) -> bool:
        return key in self._states

    def get(self, key: str) -> S | None:
        return self._states.get(key)

    def items(self) -> Iterator[tuple[str, S]]:
        return iter(self._states.items())

    def add(self, key: str, state: S) -> None:
        """Add or replace `key`, now the most recently used."""
        self._states[key] = state
        self._states.move_to_end(key)
        keys = self._by_principal.setdefault(principal_of(key), OrderedDict())
        keys[key] = None
        keys.move_to_end(key)

    def touch(self, key: str) -> None:
        """`key` (present) was just used."""
        self._states.move_to_end(key)
        self._by_principal[principal_of(key)].move_to_end(key)

    def evict(self, limit: int, evictable: Callable[[S], bool]) -> list[str]:
        """Forget producers until at most `limit` are known, only ones `evictable` allows: the least
        recently used of the principal holding the most entries first (down to the next largest
        principal's size), then the least recently used of all. Returns the keys forgotten."""
        excess = len(self._states) - limit
        if excess <= 0:
            return []
        doomed: list[str] = []
        if self._by_principal:
            sizes = sorted((len(keys), principal) for principal, keys in self._by_principal.items())
            largest_size, largest = sizes[-1]
            room = largest_size - (sizes[-2][0] if len(sizes) > 1 else 0)
            for key in self._by_principal[largest]:
                if len(doomed) >= min(excess, room):
                    break
                if evictable(self._states[key]):
                    doomed.append(key)
        if len(doomed) < excess:  # principals of one size at the top: least recently used first
            chosen = set(doomed)
            for key, state in self._states.items():
                if len(doomed) >= excess:
                    break
                if key not in chosen and evictable(state):
                    doomed.append(key)
        for key in doomed:
            principal = principal_of(key)
            del self._by_principal[principal][key], self._states[key]
            if not self._by_principal[principal]:
                del self._by_principal[principal]
        return doomed
