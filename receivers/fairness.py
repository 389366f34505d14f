"""Fair shares of a stream's credit among its owners: max-min fair, work-conserving.

An owner is who a session's credit is charged to: the principal when the caller authenticated (all its
sessions, whatever their producer ids), else the producer id, else the session alone. Per round of
credit (Receiver._replenish) each owner's demand is what it holds (credit outstanding plus records
taken and not yet durable) plus what its sessions at low tide want; the stream's buffer (records and
bytes) is split among the owners by max-min water-filling, and an owner holding its share gets nothing
more while others want. Credit is in whole records: an owner holding nothing may have one even when its
share is less (more owners than the buffer holds records of theirs), so they take turns, one record
each as the round's room allows, rather than none of them ever getting any. The round's room and rate
tokens are water-filled the same way among the owners that want, so many sessions of one owner take one
owner's share, and what one owner does not take the others get. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from receivers.principal import Principal

K = TypeVar("K", bound=Hashable)


def owner_of(principal: Principal, producer_id: str, session_id: int) -> str:
    """The owner a session's credit is charged to (the prefixes keep a producer id from posing as a
    principal)."""
    if principal.authenticated:
        return f"principal:{principal.name}"
    if producer_id:
        return f"producer:{producer_id}"
    return f"session:{session_id}"


def water_fill(capacity: float, demands: Mapping[K, float]) -> dict[K, float]:
    """Max-min fair shares of `capacity`: each gets min(demand, level), the level set so the shares
    add up to the capacity (or every demand in full when they fit: the level is then inf)."""
    shares: dict[K, float] = {}
    left = max(0.0, capacity)
    pending = sorted(demands.items(), key=lambda item: item[1])
    for i, (key, demand) in enumerate(pending):
        level = left / (len(pending) - i)
        share = min(max(0.0, demand), level)
        shares[key] = share
        left -= share
    return shares


@dataclass(frozen=True)
class OwnerDemand:
    """One owner in a round of credit."""

    held_records: int
    """Credit outstanding plus records taken and not yet durable."""
    held_bytes: float
    """Bytes of its records not yet durable plus its credit at its bytes per record."""
    want: int
    """Credit its sessions at low tide would take to reach their prefetch (0: none is at low tide)."""
    record_bytes: float
    """Its bytes per record (> 0), as the memory budget estimates them."""
    reserve: int = 0
    """Credit its open sessions may hold (a prefetch each): its demand is at least that, so a quiet
    moment of a present owner does not hand its room to a newcomer for good (credit is never taken back)."""

    @property
    def demand_records(self) -> int:
        return max(self.held_records + self.want, self.reserve)

    @property
    def demand_bytes(self) -> float:
        return max(self.held_bytes + self.want * self.record_bytes, self.reserve * self.record_bytes)


@dataclass
class Allocation:
    """What a round grants each owner, and why some got less than they wanted."""

    grants: dict[Hashable, int] = field(default_factory=dict)
    short: set[Hashable] = field(default_factory=set)
    """Owners under their share of the buffer that got less than they wanted because others hold the
    room: what a hoarder of credit costs them."""
    over: set[Hashable] = field(default_factory=set)
    """Owners holding more than their share of the buffer (records or bytes)."""
    rate_limited: bool = False
    """The rate's tokens, not the room, held some owner back."""


def allocate(
    owners: Mapping[K, OwnerDemand],
    order: Sequence[K],
    *,
    buffer_records: int,
    buffer_bytes: float,
    free_records: int,
    free_bytes: float,
    tokens: float,
) -> Allocation:
    """One round of credit: shares of the buffer (records, bytes) over every owner, then this round's
    room (`free_records`, `free_bytes`) and `tokens` (inf: no rate) over the owners that want, within
    those shares. `order` (the owners that want, rotated by the caller each round) gets the whole
    records left over by rounding, one at a time, so a few tokens among many owners still move."""
    result = Allocation()
    share_records = water_fill(buffer_records, {k: o.demand_records for k, o in owners.items()})
    share_bytes = water_fill(buffer_bytes, {k: o.demand_bytes for k, o in owners.items()})
    room: dict[K, int] = {}
    for key, owner in owners.items():
        if owner.held_records > share_records[key] + 0.5 or owner.held_bytes > share_bytes[key] * 1.001:
            result.over.add(key)
        if owner.want <= 0:
            continue
        room[key] = _room(owner, share_records[key], share_bytes[key])
    wanted = sum(room.values())
    if wanted <= 0:
        return result
    capacity = min(float(free_records), tokens)
    records = water_fill(capacity, room)
    # bytes weigh differently per owner: fill the byte room over what the records allow each
    byte_fill = water_fill(free_bytes, {k: records[k] * owners[k].record_bytes for k in room})
    grants = {k: math.floor(min(records[k], byte_fill[k] / owners[k].record_bytes) + 1e-9) for k in room}
    spare = math.floor(min(capacity, float(wanted)) + 1e-9) - sum(grants.values())
    bytes_left = free_bytes - sum(grants[k] * owners[k].record_bytes for k in room)
    progress = True
    while spare > 0 and progress:
        progress = False
        for key in order:
            fits = bytes_left >= owners[key].record_bytes
            if spare > 0 and key in room and grants[key] < room[key] and fits:
                grants[key] += 1
                spare -= 1
                bytes_left -= owners[key].record_bytes
                progress = True
    room_bound = free_records < tokens
    for key, grant in grants.items():
        if grant < room[key]:
            if room_bound or byte_fill[key] < records[key] * owners[key].record_bytes:
                result.short.add(key)
            else:
                result.rate_limited = True
        if grant > 0:
            result.grants[key] = grant
    return result


def _room(owner: OwnerDemand, share_records: float, share_bytes: float) -> int:
    """Records `owner` may be granted within its shares (and what it wants): at least one while it holds
    nothing. A share under one whole record (more owners than the buffer holds records, or than its
    bytes hold records of theirs) floored to 0: no owner ever got credit nor counted as short (so a
    hoarder of credit was never reclaimed either), and the stream stalled for good with its buffer
    empty. The round's room (allocate) still bounds what is granted."""
    by_records = share_records - owner.held_records
    by_bytes = (share_bytes - owner.held_bytes) / owner.record_bytes
    fits = math.floor(min(by_records, by_bytes) + 1e-9)
    if owner.held_records <= 0:
        fits = max(fits, 1)
    return max(0, min(owner.want, fits))
