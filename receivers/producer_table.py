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
        recently used of the principal holding the most entries first. Returns the keys forgotten."""
        forgotten: list[str] = []
        excess = len(self._states) - limit
        if excess <= 0:
            return forgotten
        # largest principals first; one pass each, so producers that may not go cost one look per call
        for principal in sorted(self._by_principal, key=lambda p: -len(self._by_principal[p])):
            keys = self._by_principal[principal]
            others = max((len(k) for p, k in self._by_principal.items() if p != principal), default=0)
            doomed: list[str] = []
            for key in keys:
                if len(forgotten) + len(doomed) >= excess or len(keys) - len(doomed) <= others:
                    break  # done, or this principal is down to the next one's size
                if evictable(self._states[key]):
                    doomed.append(key)
            for key in doomed:
                del keys[key], self._states[key]
            forgotten += doomed
            if not keys:
                del self._by_principal[principal]
        if len(forgotten) < excess:  # every principal down to the same size: least recently used first
            for key, state in list(self._states.items()):
                if len(forgotten) >= excess:
                    break
                if evictable(state):
                    principal = principal_of(key)
                    del self._by_principal[principal][key], self._states[key]
                    if not self._by_principal[principal]:
                        del self._by_principal[principal]
                    forgotten.append(key)
        return forgotten
