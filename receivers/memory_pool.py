"""The memory budget every stream of a server shares (ReceiverConfig.memory_budget_bytes).

Each receiver bounds its own stream (`buffer_bytes`: records taken and not yet durable, plus what its
outstanding credit may bring). Streams add up: twenty streams at the default 256 MiB could take 5 GiB.
A server-wide budget bounds their sum the same way, like Kafka's `queued.max.request.bytes` bounds a
broker's queued requests whatever the topic:

- a stream grants credit only within the room the budget has left: what every stream has taken and
  not yet made durable, plus what its own outstanding credit may bring (Receiver.committed_bytes). The
  credit other streams hold is not counted: idle sessions of one stream holding credit would keep
  every other stream out (a stream's own owners are policed for that: ReceiverConfig.reclaim_after);
- so streams granting at once can promise more than the budget: what bounds memory is that a session's
  next message stays unread while the bytes taken fill the budget (gRPC's flow control holds its
  producer back), as the stream's own budget does: one message per session over it, at most;
- while a receiver finds no room, every receiver is held to an equal share of the budget, so a stream
  that filled it while alone cannot keep the others out: the room its blocks free goes to the others
  first, until each holds its share.

Receivers call take() and release() as their buffered bytes move, so the check before each message is
one comparison; the sum of committed bytes (with credit) is taken only when credit is granted.
"""

from __future__ import annotations

from typing import Protocol


class PoolMember(Protocol):
    """A receiver as the pool sees it."""

    @property
    def buffered_bytes(self) -> int:
        """Bytes of records taken and not yet durable."""
        ...

    @property
    def committed_bytes(self) -> float:
        """Bytes buffered plus the bytes its outstanding credit may bring."""
        ...

    @property
    def active_sessions(self) -> int: ...

    def pool_room(self) -> None:
        """The pool has room again: let waiting sessions read and top up credit."""
        ...


class MemoryPool:
    """The bytes every member (a server's receivers) holds, against a budget each member is given."""

    def __init__(self) -> None:
        self._members: dict[int, PoolMember] = {}  # by id: asked for every message taken
        self.held = 0
        """Bytes buffered by every member: records taken and not yet in a durable block."""
        self._short: set[int] = set()
        """Members (by id) that found no room in the pool since it last had some for them."""

    def join(self, member: PoolMember) -> None:
        self._members[id(member)] = member

    def leave(self, member: PoolMember, holding: int) -> None:
        """`member` stopped (or died); `holding`: the bytes it still counted as buffered, let go now.
        What it takes or releases afterwards is not counted: it is no member any more."""
        if id(member) in self._members:
            self.release(holding, member)
            del self._members[id(member)]
            self._short.discard(id(member))

    def take(self, nbytes: int, by: PoolMember) -> None:
        if id(by) in self._members:
            self.held += nbytes

    def release(self, nbytes: int, by: PoolMember) -> None:
        """`by` let go of `nbytes` (a block made durable, records dropped): members that wait for room
        hear of it (not `by`, which tops itself up as it goes on)."""
        if id(by) not in self._members:
            return
        self.held -= nbytes
        if nbytes > 0 and self._short:
            for key in list(self._short):
                member = self._members.get(key)
                if member is not None and member is not by:
                    member.pool_room()

    def room_for(self, member: PoolMember, limit: float) -> float:
        """Bytes `member` may still commit under `limit`: what the budget has left after every member's
        records and its own credit, and while another member waits for room, no more than its equal
        share (members with sessions share it)."""
        mine = member.committed_bytes
        room = limit - (self.held - member.buffered_bytes) - mine
        if self._short - {id(member)}:
            sharing = sum(1 for m in self._members.values() if m.active_sessions > 0 or m is member)
            room = min(room, limit / max(sharing, 1) - mine)
        return room

    def short(self, member: PoolMember, short: bool) -> None:
        """Whether `member` just found too little room: to grant credit, or to read a message."""
        if short:
            self._short.add(id(member))
        else:
            self._short.discard(id(member))

    @property
    def members(self) -> int:
        return len(self._members)
