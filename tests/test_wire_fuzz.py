"""A Hypothesis state machine against the real server: random valid and invalid frames on many calls.

The server runs on its own event loop in a thread (a real grpc.aio server on loopback, the real WAL), with
a well-behaved Producer sending records throughout. Each rule acts on raw Publish calls that write bytes
(so garbage and invalid UTF-8 get through): Open with extreme values, batches in and out of order, over
credit, past the sequence range, malformed or over the message limit, Complete twice, Error, a second
Open, half-closes, client cancels, operator cancels with any code, fencing by a newer session.

Properties: every call ends, with a documented status (README, "Protocol"), the Cancel's code once one
was sent and acked up to its accepted_up_to; the server never dies; no session or credit leaks; and the
well-behaved producer loses nothing (every record it had acked is in the block log, once).
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from ingest.config import RateConfig, ServeConfig
from ingest.server import SluiceServer
from receivers.config import ReceiverConfig
from receivers.wire import SEQ_LIMIT
from sluice_client import Producer
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from sluice_client.wire import MAX_PRODUCER_ID_BYTES, encode_batch

T = TypeVar("T")
STREAM = "s"
GOOD = "well-behaved"
MAX_MESSAGE = 64 * 1024  # small, so that messages over the limit are cheap to send
Code = grpc.StatusCode
DOCUMENTED = {
    Code.OK,
    Code.INVALID_ARGUMENT,
    Code.OUT_OF_RANGE,
    Code.FAILED_PRECONDITION,
    Code.NOT_FOUND,
    Code.ALREADY_EXISTS,
    Code.RESOURCE_EXHAUSTED,
    Code.ABORTED,
    Code.UNAVAILABLE,
}
"""How a Publish call may end (README, "Protocol"), besides the code of a Cancel it was sent."""
BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}

RUN: dict[str, int] = {"examples": 0, "actions": 0, "calls": 0, "past the range": 0}
"""What a run did: examples (state machines), actions (frames sent, opens, cancels), calls, batches past
the sequence range."""


class Harness:
    """The server, its event loop thread and the well-behaved producer, shared by every example."""

    def __init__(self, data_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzzed-server", daemon=True)
        self.thread.start()
        config = ServeConfig(
            port=0,
            metrics_port=None,
            data_dir=data_dir,
            streams=(STREAM,),
            # a block interval long enough that messages often arrive while records wait for their block
            receiver=ReceiverConfig(block_interval=0.25, buffer_records=20_000, prefetch=2_000),
            rate=RateConfig(estimator="fixed", initial_rate=math.inf),
            spark=False,
            max_message_bytes=MAX_MESSAGE,
        )
        self.server = SluiceServer(config)
        self.run(self.server.start())
        self.receiver = self.server.receivers[STREAM]
        self.producer = Producer(self.server.target, STREAM, producer_id=GOOD, linger=0.001, batch_size=50)
        self.sent = 0
        self._stop_pump = asyncio.Event()
        self.run(self.producer.start())
        self.pump = asyncio.run_coroutine_threadsafe(self._pump(), self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _pump(self) -> None:
        while not self._stop_pump.is_set():
            await self.producer.send_many([f"good-{i}".encode() for i in range(self.sent, self.sent + 20)])
            self.sent += 20
            await asyncio.sleep(0.002)

    def finish_well_behaved(self) -> None:
        """Stop sending, flush and close the well-behaved producer; it must have lost nothing."""
        self.loop.call_soon_threadsafe(self._stop_pump.set)
        self.pump.result(30)
        self.run(self.producer.flush(timeout=30))
        self.run(self.producer.close())
        assert self.producer.acked == self.sent
        store = self.server.store
        values = [
            value
            for block in store.blocks(STREAM)
            for batch in store.read(block)
            for value in batch.column("value").to_pylist()
            if value.startswith(b"good-")
        ]
        assert len(values) == self.sent, "a well-behaved record is missing or stored twice"
        assert set(values) == {f"good-{i}".encode() for i in range(self.sent)}

    def close(self) -> None:
        try:
            if not self.pump.done():
                self.loop.call_soon_threadsafe(self._stop_pump.set)
                self.pump.result(30)
            self.run(self.server.stop(grace=1))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


class Call:
    """One raw Publish call and what was seen of it. The sync gRPC API on purpose: grpc.aio's client
    reports a write that races the server's end of the call as INTERNAL "Internal error from Core"
    instead of the server's status (grpc/grpc#36066), which would hide the status under test."""

    def __init__(self, target: str, first: bytes, resume_from_seq: int) -> None:
        self.resume_from_seq = self.next_seq = resume_from_seq
        self.producer_id = ""
        self.credit = 0
        self.acked: int | None = None
        self.cancel: pb.Cancel | None = None
        self.oversized = False  # sent a message over the limit (gRPC ends the call itself)
        self.client_cancelled = False
        self.half_closed = False
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.sent: list[str] = []
        self.problems: list[str] = []
        self.ended = threading.Event()
        self._requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.channel = grpc.insecure_channel(target)
        self.send(first, "open")
        self.call = self.channel.stream_stream(
            "/ingest.v1.Ingest/Publish",
            request_serializer=None,
            response_deserializer=pb.PublishResponse.FromString,
        )(iter(self._requests.get, None))
        threading.Thread(target=self._read, name="fuzz-call-reader", daemon=True).start()

    def _read(self) -> None:
        try:
            for response in self.call:
                kind = response.WhichOneof("kind")
                if kind == "request":
                    self.credit += response.request.n
                elif kind == "ack":
                    if self.acked is not None and response.ack.durable_up_to <= self.acked:
                        self.problems.append(f"ack went back: {self.acked} -> {response.ack.durable_up_to}")
                    self.acked = response.ack.durable_up_to
                elif kind == "cancel":
                    if self.cancel is not None:
                        self.problems.append("a second Cancel")
                    self.cancel = response.cancel
        except grpc.RpcError:
            pass
        finally:
            self.code = self.call.code()
            self.details = self.call.details() or ""
            self.ended.set()

    def send(self, data: bytes, what: str) -> None:
        self.sent.append(what)
        if self.half_closed:
            return
        if len(data) > MAX_MESSAGE:
            self.oversized = True
        self._requests.put(data)

    def half_close(self) -> None:
        if not self.half_closed:
            self.half_closed = True
            self._requests.put(None)

    def client_cancel(self) -> None:
        if not self.ended.is_set():
            self.client_cancelled = True
            self.call.cancel()

    def finish(self) -> None:
        """Half-close and wait for the end (every call must end: a hang fails here)."""
        self.half_close()
        assert self.ended.wait(20), f"the call never ended: {self.sent}"
        self.channel.close()


def raw_frame(**kind: Any) -> bytes:
    return pb.PublishRequest(**kind).SerializeToString()


def varint(n: int) -> bytes:
    n &= 2**64 - 1
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


seqs = st.one_of(
    st.integers(0, 100),
    st.integers(SEQ_LIMIT - 60, SEQ_LIMIT),  # where a batch of up to 50 runs past the range
    st.sampled_from([2**31, 2**32, 2**63 - 1, 2**63, SEQ_LIMIT - 1, SEQ_LIMIT]),
)
producer_ids = st.one_of(
    st.sampled_from(["", "p", "é" * (MAX_PRODUCER_ID_BYTES // 2 - 2)]),  # at the limit, with a suffix
    st.text(max_size=20),
)
bad_producer_ids = st.one_of(
    st.integers(MAX_PRODUCER_ID_BYTES + 1, 2 * MAX_PRODUCER_ID_BYTES).map(lambda n: "x" * n),
    st.just("é" * (MAX_PRODUCER_ID_BYTES // 2 + 1)),
)
bad_streams = st.sampled_from(["", "nope", "s" * 5_000])
counts = st.integers(1, 50)


def error_frame(code: int, message: str) -> bytes:
    # Error.code is an int32: a varint beyond it is what a broken client could still send
    inner = b"\x08" + varint(code) + pb.Error(message=message).SerializeToString()
    return b"\x22" + varint(len(inner)) + inner


bad_opens = st.one_of(
    bad_producer_ids.map(lambda p: raw_frame(open=pb.Open(stream=STREAM, producer_id=p))),
    bad_streams.map(lambda s: raw_frame(open=pb.Open(stream=s))),
    st.binary(max_size=64),
)
hostile_frames = st.one_of(
    st.tuples(st.just("garbage"), st.binary(max_size=64)),
    st.tuples(st.just("empty"), st.just(b"")),
    st.tuples(st.just("complete"), st.just(raw_frame(complete={}))),
    st.tuples(
        st.just("error"), st.builds(error_frame, st.integers(-(2**63), 2**64 - 1), st.text(max_size=50))
    ),
    st.tuples(
        st.just("open again"),
        st.builds(
            lambda p, r: raw_frame(open=pb.Open(stream=STREAM, producer_id=p, resume_from_seq=r)),
            producer_ids,
            seqs,
        ),
    ),
    st.tuples(
        st.just("malformed batch"),
        st.builds(
            lambda **f: raw_frame(batch=pb.Batch(**f)),
            first_seq=seqs,
            count=st.one_of(st.integers(0, 10), st.just(2**32 - 1)),
            values=st.binary(max_size=16),
            value_offsets=st.binary(max_size=48),
            keys=st.binary(max_size=8),
            key_offsets=st.binary(max_size=48),
            key_validity=st.binary(max_size=4),
        ),
    ),
    st.tuples(
        st.just("oversized"),
        st.integers(1, 1_000).map(lambda n: raw_frame(batch=encode_batch(0, [b"o" * (MAX_MESSAGE + n)]))),
    ),
)
"""Frames a broken or hostile client sends on an open call (one rule, so that well-behaved steps, which
take several rules, are most of a run and sessions live long enough to reach deep states)."""


class WireMachine(RuleBasedStateMachine):
    harness: Harness

    calls = Bundle("calls")

    def __init__(self) -> None:
        super().__init__()
        self.all_calls: list[Call] = []
        self.opened = 0
        RUN["examples"] += 1

    def new_call(self, first: bytes, resume_from_seq: int, producer_id: str = "") -> Call:
        RUN["actions"] += 1
        call = Call(self.harness.server.target, first, resume_from_seq)
        call.producer_id = producer_id
        self.all_calls.append(call)
        RUN["calls"] += 1
        return call

    def send(self, call: Call, data: bytes, what: str) -> None:
        RUN["actions"] += 1
        call.send(data, what)

    def send_batch(self, call: Call, first: int, count: int, keyed: bool = False) -> None:
        first = min(max(first, 0), SEQ_LIMIT)  # what a uint64 holds; beyond the range is still sent
        keys = [b"k" if i % 2 else None for i in range(count)] if keyed else None
        data = raw_frame(batch=encode_batch(first, [b"v" * 10] * count, keys))
        self.send(call, data, f"batch {first}+{count}")
        if first == call.next_seq:
            call.next_seq = first + count
            RUN["past the range"] += call.next_seq > SEQ_LIMIT

    # ---- well-behaved steps, at the edges of what is allowed -------------------------------------

    @initialize(target=calls)
    def first_call(self) -> Call:
        return self.open_call("", 0)

    @rule(
        target=calls,
        producer_id=producer_ids,
        resume_from_seq=seqs,
        resume=st.booleans(),
        fresh=st.booleans(),
    )
    def open_call(
        self, producer_id: str, resume_from_seq: int, resume: bool = False, fresh: bool = False
    ) -> Call:
        if producer_id:  # one producer per call (fence() makes the others), so an operator can find it
            self.opened += 1
            producer_id = f"{producer_id}{self.opened:02d}"
        opening = pb.Open(
            stream=STREAM,
            producer_id=producer_id,
            resume_from_seq=resume_from_seq,
            resume=resume,
            fresh=fresh,
        )
        return self.new_call(raw_frame(open=opening), resume_from_seq, producer_id)

    @rule(target=calls, producer_id=producer_ids, left=st.integers(0, 60))
    def open_near_the_end(self, producer_id: str, left: int) -> Call:
        return self.open_call(producer_id, SEQ_LIMIT - left)

    @rule(target=calls, call=calls)
    def fence(self, call: Call) -> Call:
        """A newer session of the same producer, resuming where the old one got to."""
        resume = min(call.next_seq, SEQ_LIMIT)
        opening = pb.Open(stream=STREAM, producer_id=call.producer_id, resume_from_seq=resume)
        return self.new_call(raw_frame(open=opening), resume, call.producer_id)

    @rule(target=calls, call=calls, resume_from_seq=seqs)
    def new_run(self, call: Call, resume_from_seq: int) -> Call:
        """A new run of the same producer (Open.fresh): ALREADY_EXISTS if the server took records of it
        from resume_from_seq on, else a newer session that fences the old one."""
        opening = pb.Open(
            stream=STREAM, producer_id=call.producer_id, resume_from_seq=resume_from_seq, fresh=True
        )
        return self.new_call(raw_frame(open=opening), resume_from_seq, call.producer_id)

    @rule(call=calls, count=counts, keyed=st.booleans())
    def batch(self, call: Call, count: int, keyed: bool) -> None:
        self.send_batch(call, call.next_seq, count, keyed)

    @rule(call=calls)
    def batch_within_credit(self, call: Call) -> None:
        self.send_batch(call, call.next_seq, max(1, min(call.credit, 100)))

    @rule(call=calls, beyond=st.integers(-2, 2))
    def batch_to_the_end(self, call: Call, beyond: int) -> None:
        """A batch that ends at the end of the sequence range, or just before or past it."""
        count = SEQ_LIMIT - call.next_seq + beyond
        if call.next_seq <= SEQ_LIMIT and 1 <= count <= 100:
            self.send_batch(call, call.next_seq, count)

    @rule(call=calls)
    def complete(self, call: Call) -> None:
        self.send(call, raw_frame(complete={}), "complete")

    @rule(call=calls)
    def half_close(self, call: Call) -> None:
        RUN["actions"] += 1
        call.sent.append("half-close")
        call.half_close()

    @rule(target=calls, call=calls, by_operator=st.booleans(), frame=hostile_frames)
    def cancel_in_flight(self, call: Call, by_operator: bool, frame: tuple[str, bytes]) -> Call:
        """Records, then the server's Cancel (an operator's, or a newer session's) while they wait for
        their block, then a broken message: it must not change how the call ends."""
        self.send_batch(call, call.next_seq, 5)
        newer = call
        if by_operator or not call.producer_id:
            self.operator_cancel(call, 0, 0, "maintenance")
        else:
            newer = self.fence(call)
        self.hostile(call, frame)
        return newer

    @rule(call=calls, pick=st.integers(0, 100), code=st.integers(0, 16), reason=st.text(max_size=300))
    def operator_cancel(self, call: Call, pick: int, code: int, reason: str) -> None:
        """Sessions.CancelSession with any code (0: CANCELLED) and reason, of the call's session (a
        named producer's newest; any anonymous one for an anonymous call), or of no session at all."""
        RUN["actions"] += 1

        async def session_ids() -> list[int]:
            return [s.id for s in self.harness.receiver.sessions if s.producer_id == call.producer_id]

        ids = self.harness.run(session_ids())
        session_id = ids[-1 if call.producer_id else pick % len(ids)] if ids else 10**9 + pick
        with grpc.insecure_channel(self.harness.server.target) as channel:
            try:
                pb_grpc.SessionsStub(channel).CancelSession(
                    pb.CancelSessionRequest(session_id=session_id, code=code, reason=reason), timeout=10
                )
            except grpc.RpcError as exc:
                assert exc.code() in (Code.NOT_FOUND, Code.INVALID_ARGUMENT), exc  # type: ignore[attr-defined]

    # ---- hostile steps ---------------------------------------------------------------------------

    @rule(call=calls, frame=hostile_frames)
    def hostile(self, call: Call, frame: tuple[str, bytes]) -> None:
        self.send(call, frame[1], frame[0])

    @rule(call=calls, shift=st.one_of(st.integers(-3, 3), seqs), count=st.one_of(counts, st.just(20_000)))
    def batch_out_of_order(self, call: Call, shift: int, count: int) -> None:
        """A repeat, a step back, a gap (a known producer's OUT_OF_RANGE), or more than the credit."""
        self.send_batch(call, call.next_seq + shift if -3 <= shift <= 3 else shift, count)

    @rule(target=calls, first=bad_opens)
    def bad_open(self, first: bytes) -> Call:
        return self.new_call(first, 0)

    @rule(call=calls)
    def client_cancel(self, call: Call) -> None:
        RUN["actions"] += 1
        call.sent.append("client cancel")
        call.client_cancel()

    # ---- properties --------------------------------------------------------------------------------

    def teardown(self) -> None:
        try:
            for call in self.all_calls:
                call.finish()
                self.check_end(call)
            self.harness.run(self.check_server())
        finally:
            for call in self.all_calls:
                call.client_cancel()
                call.channel.close()

    def check_end(self, call: Call) -> None:
        assert call.code is not None
        story = f"{call.sent} -> {call.code} {call.details[:200]!r}"
        assert not call.problems, f"{call.problems}: {story}"
        if call.client_cancelled and call.code == Code.CANCELLED:
            return  # the client's own status
        if call.oversized and call.code == Code.RESOURCE_EXHAUSTED:
            return  # gRPC's own limit ends the call at once, whatever came before
        if call.cancel is not None:
            assert call.code == BY_NUMBER[call.cancel.code], f"not the Cancel's code: {story}"
            acked = call.resume_from_seq if call.acked is None else call.acked
            assert acked == call.cancel.accepted_up_to, f"not acked up to accepted_up_to: {story}"
            return
        assert call.code in DOCUMENTED, f"undocumented status: {story}"

    async def check_server(self) -> None:
        receiver = self.harness.receiver
        for _ in range(1_000):  # sessions end as their calls' handlers finish
            good = [s for s in receiver.sessions if s.producer_id == GOOD]
            settled = receiver.credit_outstanding == sum(s.credit for s in good)
            if len(receiver.sessions) == len(good) and settled:
                break
            await asyncio.sleep(0.01)
        stray = [(s.id, s.producer_id[:20], s.credit) for s in receiver.sessions if s.producer_id != GOOD]
        assert not stray, f"sessions leaked: {stray}"
        assert receiver.credit_outstanding == sum(s.credit for s in receiver.sessions), "credit leaked"
        assert receiver._task is not None and not receiver._task.done(), "the block generator died"
        assert self.harness.producer._error is None, "the well-behaved producer failed"


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    try:
        yield h
    finally:
        h.close()


def test_hostile_frames_never_hurt_the_server_or_the_well_behaved(harness: Harness) -> None:
    WireMachine.harness = harness
    RUN.update(dict.fromkeys(RUN, 0))
    run_state_machine_as_test(
        WireMachine,
        settings=settings(
            max_examples=100,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        ),
    )
    print("wire fuzz:", ", ".join(f"{n} {what}" for what, n in RUN.items()))
    harness.finish_well_behaved()
    receiver = harness.receiver
    assert receiver.active_sessions == 0 and receiver.credit_outstanding == 0
    assert receiver.buffered_records == 0 and receiver.buffered_bytes == 0
    # every record taken from any session went into the log: nothing taken was dropped
    assert receiver.stats.records_received == receiver.stats.records_acked
