"""Bounded resources on real parts: the memory budget, the disk budget (released by a second store, as
Spark's process does), and a really full disk (a small tmpfs): credit pauses, says why, loses nothing,
and resumes by itself."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import math
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import pytest
from prometheus_client import generate_latest
from support import running_server, wait_until

from ingest.cli import _show_rate
from ingest.rate_service import rate_status
from ingest.server import SluiceServer
from receivers.block import ARRIVAL, PLAIN_SCHEMA
from receivers.config import MIB, FsyncPolicy, ReceiverConfig
from receivers.receiver import DISK_BUDGET, DISK_ERROR, MEMORY_BUDGET, SERVER_MEMORY
from receivers.wal import WalBlockStore
from sluice_client import Producer
from sluice_client.errors import RPCError
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb


def records(prefix: str, n: int, size: int) -> list[bytes]:
    return [f"{prefix}{i:08d}".encode().ljust(size, b".") for i in range(n)]


def fill(path: Path, size: int) -> None:
    with open(path, "wb") as file:
        file.write(b"\0" * size)


def batch(*values: bytes) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [
            pa.array([None] * len(values), pa.binary()),
            pa.array(values, pa.binary()),
            pa.array([1_000_000] * len(values), ARRIVAL),
        ],
        schema=PLAIN_SCHEMA,
    )


def paused_metric(server: SluiceServer, reason: str, stream: str = "s") -> float | None:
    return server.registry.get_sample_value("sluice_credit_paused", {"stream": stream, "reason": reason})


def held_writes(receiver: Any, *, held: bool = False) -> tuple[threading.Event, contextlib.AsyncExitStack]:
    """Make `receiver`'s block writes wait while the returned gate is clear (`held`: clear at first); the
    returned stack sets it on exit, so a failing test never leaves the writer blocked."""
    gate = threading.Event()
    if not held:
        gate.set()
    write = receiver.store.write

    def gated_write(*args: Any) -> Any:
        gate.wait(30)
        return write(*args)

    receiver.store.write = gated_write
    closing = contextlib.AsyncExitStack()
    closing.callback(gate.set)
    return gate, closing


class Spark:
    """What Spark's commit does, from a store of its own (another process in production): read the
    blocks not yet released, then release them."""

    def __init__(self, root: Path) -> None:
        self.store = WalBlockStore(root, fsync=FsyncPolicy.off())
        self.consumed: list[bytes] = []

    def stored(self, stream: str = "s") -> list[bytes]:
        """Every record value in blocks not yet released."""
        return [
            v
            for b in self.store.blocks(stream)
            for batch in self.store.read(b)
            for v in batch.column("value").to_pylist()
        ]

    def commit(self, stream: str = "s") -> int:
        blocks = self.store.blocks(stream)
        for block in blocks:
            for batch in self.store.read(block):
                self.consumed += batch.column("value").to_pylist()
        if blocks:
            self.store.release(stream, blocks[-1].seq + 1)
        return len(blocks)


# ---- memory budget -------------------------------------------------------------------------------


class Peak:
    """The largest value `read()` gave, polled every `every` seconds from now until stop()."""

    def __init__(self, read: Callable[[], int], every: float = 0.001) -> None:
        self.value = 0
        self._task = asyncio.create_task(self._poll(read, every))

    async def _poll(self, read: Callable[[], int], every: float) -> None:
        while True:
            self.value = max(self.value, read())
            await asyncio.sleep(every)

    def stop(self) -> None:
        self._task.cancel()


async def test_memory_budget_stops_credit_for_large_records_and_resumes_as_blocks_seal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    budget, size = 500_000, 10_000
    async with running_server(
        tmp_path, buffer_bytes=budget, buffer_records=100_000, prefetch=10_000, low_tide=5_000
    ) as server:
        receiver = server.receivers["s"]
        gate, closing = held_writes(receiver)
        async with (
            closing,
            Producer(server.target, "s", linger=0, batch_size=5, producer_id="big") as producer,
        ):
            # before any record is seen the receiver assumes 1 KiB a record: the first grant is that
            await wait_until(lambda: producer.credit > 0)
            first = producer.credit
            assert first == budget // 1024
            warmup = records("w", first, size)
            await producer.send_many(warmup)
            await producer.flush(timeout=30)
            assert receiver.record_bytes_estimate >= size
            # now the estimate is right: with blocks not sealing, the buffer stays within the budget
            gate.clear()
            caplog.set_level(logging.DEBUG, logger="receivers.receiver")
            main = records("m", 300, size)
            sending = asyncio.create_task(producer.send_many(main))
            await wait_until(lambda: MEMORY_BUDGET in receiver.paused)
            await wait_until(lambda: producer.credit == 0 and receiver.credit_outstanding == 0)
            granted = receiver.stats.credit_granted
            await asyncio.sleep(0.3)
            assert receiver.stats.credit_granted == granted  # no credit while the budget is used up
            assert producer.sent < len(warmup) + len(main)
            assert receiver.buffered_bytes <= budget * 1.01  # the estimate is right to a few bytes
            assert receiver.buffered_bytes > budget - 2 * size
            assert paused_metric(server, MEMORY_BUDGET) == 1
            assert paused_metric(server, DISK_BUDGET) == paused_metric(server, DISK_ERROR) == 0
            assert "credit paused: memory budget 488.3 KiB reached" in caplog.text
            gate.set()
            await asyncio.wait_for(sending, 30)
            await producer.flush(timeout=30)
            assert producer.acked == len(warmup) + len(main)
        await wait_until(lambda: MEMORY_BUDGET not in receiver.paused)
        assert receiver.stats.credit_pauses[MEMORY_BUDGET] >= 1
        assert receiver.buffered_bytes == 0
        assert Spark(server.config.blocks_dir).stored() == warmup + main


@pytest.mark.parametrize("estimate", ["first grant", "after small records"])
async def test_records_larger_than_the_estimate_wait_unread_beyond_the_memory_budget(
    tmp_path: Path, estimate: str
) -> None:
    """Credit counts records, sized with an estimate. Records larger than it (the first grant assumes
    1 KiB; a producer may switch from small records to large ones) could bring many times the budget on
    credit already granted: with the defaults, 64 KiB records took the server to 5 GB of RSS against a
    256 MiB budget. Now, once the records taken fill the budget, the next message stays unread (gRPC's
    flow control holds the producer back) until blocks are written: one message over, at most."""
    budget, size, per_message = 1_000_000, 64 * 1024, 4
    async with running_server(tmp_path, buffer_bytes=budget) as server:
        receiver = server.receivers["s"]
        gate, closing = held_writes(receiver)
        async with (
            closing,
            Producer(server.target, "s", linger=0, batch_size=per_message, producer_id="p") as producer,
        ):
            sent: list[bytes] = []
            if estimate == "after small records":
                sent += records("s", 5_000, 100)
                await producer.send_many(sent)
                await producer.flush(timeout=30)
                assert receiver.record_bytes_estimate < 200
            await wait_until(lambda: producer.credit > 0)
            big = records("b", producer.credit, size)  # what the credit held allows: 64 MB or more
            assert len(big) * size > 50 * budget
            gate.clear()
            peak = Peak(lambda: receiver.buffered_bytes)
            sending = asyncio.create_task(producer.send_many(big))
            await wait_until(lambda: receiver.over_memory_budget)
            await asyncio.sleep(0.3)
            taken = receiver.stats.records_received
            await asyncio.sleep(0.3)
            assert receiver.stats.records_received == taken  # held back: nothing more is read
            assert producer.credit > 0  # by the unread messages, not by credit
            message = per_message * (size + 64)
            assert budget <= peak.value <= budget + message
            gate.set()
            await asyncio.wait_for(sending, 30)
            await producer.flush(timeout=30)
            peak.stop()
            assert peak.value <= budget + message
            assert producer.acked == len(sent) + len(big)
        assert receiver.buffered_bytes == 0
        assert Spark(server.config.blocks_dir).stored() == sent + big


async def test_blocks_are_sealed_at_a_quarter_of_the_memory_budget_whatever_their_count(
    tmp_path: Path,
) -> None:
    """Blocks were sealed early by count only (a quarter of buffer_records): 1 KiB records made blocks of
    122 MB, 64 KiB ones of up to the whole budget, and the log's frame buffers, kept at the largest
    block's size, grew with them. A quarter of buffer_bytes seals a block too."""
    budget, size, per_message = 2_000_000, 10_000, 5
    async with (
        running_server(tmp_path, buffer_bytes=budget, block_interval=5.0, block_linger=None) as server,
        Producer(server.target, "s", linger=0, batch_size=per_message) as producer,
    ):
        receiver = server.receivers["s"]
        assert receiver.config.seal_at == 125_000 and receiver.config.seal_bytes == budget // 4
        values = records("r", 1_000, size)
        await producer.send_many(values)
        await producer.flush(timeout=30)  # within one block interval: sealed by bytes, not by time
        blocks = Spark(server.config.blocks_dir).store.blocks("s")
        assert receiver.stats.blocks_sealed == len(blocks) >= 10
        # a block is sealed once a quarter of the budget waits; one written meanwhile may hold two
        sizes = sorted(b.count * size for b in blocks)
        assert sizes[len(sizes) // 2] <= budget // 4 + per_message * size
        assert sizes[-1] <= budget + per_message * size
    assert Spark(server.config.blocks_dir).stored() == values


@pytest.mark.parametrize("cap", ["records", "bytes"])
async def test_a_log_that_falls_behind_still_writes_blocks_of_a_blocks_worth(
    tmp_path: Path, cap: str
) -> None:
    """What piled up while the log was slow went into one block: with large records blocks of up to the
    whole budget (1.3 GB with 64 KiB records), and the log's frame buffers, kept at the largest block's
    size, with them. A block now takes a block's worth (a quarter of the buffer's records or bytes),
    one message more at most; the rest follows in the next blocks."""
    size, per_message = 1_000, 10
    limits = (
        {"buffer_records": 2_000, "buffer_bytes": 100_000_000}
        if cap == "records"
        else {"buffer_records": 1_000_000, "buffer_bytes": 2_000_000}
    )
    async with running_server(tmp_path, **limits) as server:
        receiver = server.receivers["s"]
        gate, closing = held_writes(receiver, held=True)
        async with closing, Producer(server.target, "s", linger=0, batch_size=per_message) as producer:
            values = records("r", 3_000, size)
            sending = asyncio.create_task(producer.send_many(values))
            # the first block is being written (held); records pile up behind it
            await wait_until(lambda: receiver.stats.records_received >= 1_500)
            gate.set()
            await asyncio.wait_for(sending, 30)
            await producer.flush(timeout=30)
        config = receiver.config
        # by bytes: records are taken while the block holds under seal_bytes, each at least its value and
        # its int32 offset in memory (the arrival times are one run a message: no bytes a record since
        # f628b39, whose 8 the old `size + 16` still counted, so a block of 507 failed a bound of 502)
        most = config.seal_at if cap == "records" else config.seal_bytes // (size + 4) + 1
        blocks = Spark(server.config.blocks_dir).store.blocks("s")
        assert max(b.count for b in blocks) <= most + per_message
    assert Spark(server.config.blocks_dir).stored() == values


def test_rate_get_shows_why_credit_is_paused(capsys: pytest.CaptureFixture[str]) -> None:
    status = pb.RateStatus(
        records_per_second=math.inf,
        streams=[
            pb.StreamRate(stream="a", records_per_second=math.inf, credit_paused=[DISK_BUDGET, DISK_ERROR]),
            pb.StreamRate(stream="b", records_per_second=math.inf),
        ],
    )
    assert _show_rate(status) == 0
    out = capsys.readouterr().out
    assert "stream a: unlimited records/s (credit paused: disk_budget, disk_error)\n" in out
    assert "stream b: unlimited records/s\n" in out


async def test_a_memory_budget_below_one_record_slows_but_never_stalls(tmp_path: Path) -> None:
    async with (
        running_server(tmp_path, buffer_bytes=100) as server,
        Producer(server.target, "s", linger=0) as producer,
    ):
        await producer.send_many(records("t", 20, 1_000))
        await producer.flush(timeout=30)
        assert producer.acked == 20
        stats = server.receivers["s"].stats
        assert stats.batches_received == 20  # a record at a time
        assert stats.credit_granted == 21  # the last one waits, unused, for a 21st record


def test_budgets_are_validated() -> None:
    with pytest.raises(ValueError, match="buffer_bytes"):
        ReceiverConfig(buffer_bytes=0)
    with pytest.raises(ValueError, match="disk_budget_bytes"):
        ReceiverConfig(disk_budget_bytes=0)
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        ReceiverConfig(memory_budget_bytes=0)
    with pytest.raises(ValueError, match="disk_poll_interval"):
        ReceiverConfig(disk_poll_interval=0)


async def test_one_large_record_does_not_starve_the_streams_new_producers(tmp_path: Path) -> None:
    """One 30 MiB record (under the message limit) weighed as much in the stream's bytes-per-record
    estimate as a batch of thousands of small ones: the estimate stayed at MiBs for some 80 batches, a
    new producer is budgeted at it, and with many sessions open a push of 10 records got no credit."""
    import grpc

    from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

    async with running_server(tmp_path, "s") as server:
        async with Producer(server.target, "s", producer_id="big") as producer:
            await producer.send(b"x" * (30 * 1024 * 1024))
            await producer.flush(timeout=30)
            await producer.send_many([b"small record"] * 2_000)
            await producer.flush(timeout=30)
        assert server.receivers["s"].record_bytes_estimate < 64 * 1024
        async with grpc.aio.insecure_channel(server.target) as channel:
            idle = []  # sessions that open and send nothing: each is granted its share
            for i in range(200):
                call = pb_grpc.IngestStub(channel).Publish()
                await call.write(pb.PublishRequest(open=pb.Open(stream="s", producer_id=f"idle-{i}")))
                idle.append(call)
            async with Producer(server.target, "s", linger=0) as late:
                await late.send_many([b"late"] * 10)
                await late.flush(timeout=15)
            for call in idle:
                call.cancel()


@pytest.mark.parametrize(
    ("case", "producers", "size", "receiver"),
    [
        # what a helper once saw: 200 KB records, a 1 MiB budget, 256 KiB messages; the first
        # producer took the first grant (1,024 records at 1 KiB), finished and stayed open holding
        # the rest: "0 B buffered + 1024 records of credit outstanding", and no flush ended
        ("a finished producer holds its first grant", 8, 200_000, {"buffer_bytes": MIB}),
        # the same producers each closing once flushed: nothing held, nothing paused, no credit
        ("each closes once flushed", 8, 200_000, {"buffer_bytes": MIB}),
        ("more producers than the budget holds records", 6, 250_000, {"buffer_bytes": MIB}),
        # the records bound: 4 records buffered plus credit outstanding among 8 producers
        ("more producers than buffer_records", 8, 100, {"buffer_records": 4}),
    ],
    ids=["hoarder", "closing", "250KB", "records"],
)
async def test_producers_whose_fair_share_is_under_one_record_all_get_their_turn(
    tmp_path: Path, case: str, producers: int, size: int, receiver: dict[str, int]
) -> None:
    """Each owner's fair share of the buffer is the buffer split among the owners; floored to whole
    records, a share under one record was none. With more producers than the budget holds records of
    theirs (1 MiB among 6 or more producers of 200 KB), no producer got credit, none counted as short
    of room, so one holding credit unused was never reclaimed either: every flush waited for good. Now
    an owner holding nothing may have one record, within the stream's room: each gets its turn as
    blocks are written, the memory budget holds, and every record is stored once, in order."""
    per_producer, message = 8, 256 * 1024
    async with running_server(tmp_path, max_message_bytes=message, **receiver) as server:
        rec = server.receivers["s"]
        sent = {f"p{i}": records(f"p{i}-", per_producer, size) for i in range(producers)}

        async def run(producer: Producer, values: list[bytes]) -> None:
            await producer.send_many(values)
            await producer.flush(timeout=60)  # generous: 0.2-1.5 s here; before, never

        async def one(name: str) -> None:
            async with Producer(server.target, "s", producer_id=name) as producer:
                await run(producer, sent[name])

        peak = Peak(lambda: rec.buffered_bytes)
        try:
            if case == "a finished producer holds its first grant":
                async with Producer(server.target, "s", producer_id="p0") as first:
                    await run(first, sent["p0"])  # the estimate is 200 KB a record from here on
                    assert first.credit > 0
                    await asyncio.gather(*(one(name) for name in sent if name != "p0"))
            else:
                await asyncio.gather(*(one(name) for name in sent))
        finally:
            peak.stop()
        # the budget's bound: one message per session over it at most
        assert peak.value <= rec.config.buffer_bytes + producers * message
    stored = Spark(server.config.blocks_dir).stored()
    for name, values in sent.items():
        assert [v for v in stored if v.startswith(f"{name}-".encode())] == values
    assert len(stored) == producers * per_producer


async def test_the_servers_memory_budget_bounds_every_stream_together_and_shares_it(tmp_path: Path) -> None:
    """Each stream's budget bounds that stream alone, so streams added up: twenty at the default 256 MiB
    could take 5 GiB. With memory_budget_bytes, every stream's records taken and not yet durable stay
    within one budget (one message per session over at most), credit pauses with its own reason, and a
    stream that filled it while alone does not keep the others out: they get an equal share."""
    budget, size, per_message = 2_000_000, 10_000, 5
    message = per_message * (size + 64)
    async with running_server(
        tmp_path,
        "a",
        "b",
        "c",
        buffer_bytes=4 * budget,  # each stream's own budget alone would let one take twice the server's
        memory_budget_bytes=budget,
        buffer_records=100_000,
        prefetch=300,  # 3 MB of credit a session: over the server's budget, within the stream's
    ) as server:
        producers = {
            s: Producer(server.target, s, linger=0, batch_size=per_message, producer_id=s) for s in "abc"
        }
        async with contextlib.AsyncExitStack() as stack:
            for producer in producers.values():
                await stack.enter_async_context(producer)
            sent: dict[str, list[bytes]] = {}
            for s, producer in producers.items():  # the estimates learn the records' size
                sent[s] = records(f"{s}-w", 20, size)
                await producer.send_many(sent[s])
                await producer.flush(timeout=30)
            gate, closing = held_writes(server.receivers["a"])  # one store: every stream's writes wait
            await stack.enter_async_context(closing)
            gate.clear()
            peak = Peak(lambda: server.memory.held)
            stack.callback(peak.stop)
            big = records("a-", 1_000, size)  # 10 MB: five times the server's budget
            sent["a"] += big
            sending = [asyncio.create_task(producers["a"].send_many(big))]
            # until "a" holds the whole budget (held first passes budget - 2 messages, then the budget:
            # asserting at the first crossing raced the next message on a loaded machine)
            await wait_until(
                lambda: "a" in {r.stream for r in server.receivers.values() if r.over_memory_budget},
                timeout=30,
            )
            assert server.memory.held >= budget - 2 * message
            await wait_until(lambda: SERVER_MEMORY in server.receivers["a"].paused)
            assert paused_metric(server, SERVER_MEMORY, "a") == 1
            assert MEMORY_BUDGET not in server.receivers["a"].paused  # its own budget is far off
            for s in "bc":  # the others find the budget full: their credit (from before) goes unread
                more = records(f"{s}-", 200, size)
                sent[s] += more
                sending.append(asyncio.create_task(producers[s].send_many(more)))
            for s in "bc":
                await wait_until(lambda s=s: server.receivers[s].stats.records_received > 20)
            taken = {s: r.stats.records_received for s, r in server.receivers.items()}
            await asyncio.sleep(0.3)
            assert {s: r.stats.records_received for s, r in server.receivers.items()} == taken
            assert taken["b"] == taken["c"] == 20 + per_message  # a message each past the budget
            assert peak.value <= budget + 3 * message  # one message per session past it, at most

            # writes go on, slowly: b and c get their share while a still has most of its records
            gate.set()
            write = server.store.write

            def slow_write(*args: Any) -> Any:
                time.sleep(0.05)
                return write(*args)

            server.store.write = slow_write  # type: ignore[method-assign]
            await wait_until(lambda: producers["b"].acked == len(sent["b"]), timeout=60)
            await wait_until(lambda: producers["c"].acked == len(sent["c"]), timeout=60)
            assert producers["a"].acked < len(sent["a"]) - 200  # b and c were not held until a was done
            await asyncio.wait_for(asyncio.gather(*sending), 60)
            for producer in producers.values():
                await producer.flush(timeout=60)
            assert peak.value <= budget + 3 * message
        assert server.memory.held == 0
        for s in "abc":
            assert SERVER_MEMORY not in server.receivers[s].paused
        stored = Spark(server.config.blocks_dir)
        for s in "abc":
            assert stored.stored(s) == sent[s]


async def test_a_session_hoarding_credit_does_not_keep_its_streams_others_out_of_the_servers_budget(
    tmp_path: Path,
) -> None:
    """A session granted credit at the first estimate (1 KiB a record), that sent one 1 MiB record and
    then sat on the rest, counted as gigabytes of the server's budget: every other session of its stream
    got nothing until it left (22 s). The stream's own budget reclaims such a hoarder; the server's
    budget now goes through the same round of shares, so it does too."""
    budget = 8 * 1024 * 1024
    async with running_server(tmp_path, memory_budget_bytes=budget, reclaim_after=0.5) as server:
        idler = Producer(server.target, "s", producer_id="idler", linger=0)
        await idler.start()
        await idler.send(b"i" * (1024 * 1024))
        await idler.flush(timeout=30)
        assert idler.credit > 1000  # gigabytes of credit at its records' size
        started = time.monotonic()
        async with Producer(server.target, "s", producer_id="late", linger=0) as late:
            await late.send(b"l" * (1024 * 1024))
            await late.flush(timeout=30)
        assert time.monotonic() - started < 10
        await idler.abort()


async def test_a_full_server_budget_seals_without_waiting_for_the_interval(tmp_path: Path) -> None:
    """With the block linger off and a long interval, a full server budget sealed nothing (a stream's
    own budget seals at a quarter of it): intake went at one budget per block interval. Blocks now seal
    at a quarter of the smaller budget, and a stream the server's budget pauses seals what waits."""
    budget, size = 4 * 1024 * 1024, 512 * 1024
    async with running_server(
        tmp_path, "a", "b", memory_budget_bytes=budget, block_interval=5.0, block_linger=None
    ) as server:
        started = time.monotonic()
        values = {s: records(f"{s}-", 24, size) for s in "ab"}  # 12 MB each, 3 budgets

        async def push(stream: str) -> int:
            async with Producer(server.target, stream, linger=0, batch_size=2) as producer:
                await producer.send_many(values[stream])
                await producer.flush(timeout=60)
                return producer.acked

        assert await asyncio.gather(push("a"), push("b")) == [24, 24]
        assert time.monotonic() - started < 5  # not a block interval per budget's worth
    stored = Spark(server.config.blocks_dir)
    assert stored.stored("a") == values["a"] and stored.stored("b") == values["b"]


async def test_records_no_write_took_are_named_when_the_stop_drops_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A disk that stays full to the stop: the records taken were dropped, unacked, under a clean
    "stopped", with nothing said of them."""
    async with running_server(tmp_path) as server:
        receiver = server.receivers["s"]

        def full(*args: Any) -> Any:
            raise OSError(28, "No space left on device")

        server.store.write = full  # type: ignore[method-assign]
        producer = Producer(server.target, "s", linger=0)
        await producer.start()
        await producer.send_many(records("f", 1_000, 100))
        await wait_until(lambda: DISK_ERROR in receiver.paused and receiver.buffered_records == 1_000)
        caplog.set_level(logging.WARNING, logger="receivers.receiver")
        await server.stop()
        assert producer.acked == 0
        # the session lost with records unacked: abort() at once, not after the reconnect timeout (its
        # cancel of the session's supervisor was swallowed while the send loop was reaped: 60 s)
        started = time.monotonic()
        assert len(await producer.abort()) == 1_000
        assert time.monotonic() - started < 5
    assert (
        "stream 's': 1000 records taken and never made durable are dropped with the stop "
        "([Errno 28] No space left on device); they were not acked" in caplog.text
    )
    assert "Traceback" not in caplog.text


# ---- disk budget ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "segment_bytes",
    [None, 1 << 20],
    ids=["segments-a-quarter-of-the-budget", "one-segment-larger-than-the-budget"],
)
async def test_disk_budget_pauses_credit_until_spark_releases_blocks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, segment_bytes: int | None
) -> None:
    budget = 200_000
    caplog.set_level(logging.INFO, logger="receivers.receiver")
    async with running_server(
        tmp_path,
        metrics=True,
        segment_bytes=segment_bytes,
        disk_budget_bytes=budget,
        disk_poll_interval=0.05,
        buffer_records=400,
        prefetch=200,
        low_tide=50,
    ) as server:
        receiver = server.receivers["s"]
        spark = Spark(server.config.blocks_dir)
        sent = records("d", 2_000, 1_000)  # ten times the budget
        async with Producer(server.target, "s", linger=0, batch_size=50, producer_id="p") as producer:
            sending = asyncio.create_task(producer.send_many(sent))
            await wait_until(lambda: DISK_BUDGET in receiver.paused)
            await wait_until(lambda: receiver.credit_outstanding == 0 and receiver.buffered_records == 0)
            granted = receiver.stats.credit_granted
            await asyncio.sleep(0.3)
            assert receiver.stats.credit_granted == granted  # paused: nothing more comes in
            assert producer.sent < len(sent)
            assert server.store.disk_bytes() >= budget
            # soft limit: over by at most what had been granted when it was reached
            assert server.store.disk_bytes() < budget + 400 * 1_100 + 4096
            assert paused_metric(server, DISK_BUDGET) == 1
            assert server.registry.get_sample_value("sluice_wal_disk_budget_bytes") == budget
            assert "credit paused: disk budget 195.3 KiB reached" in caplog.text
            assert "resumes when Spark releases blocks" in caplog.text
            status = rate_status(server.rate)  # what `sluice rate get` shows
            assert [list(s.credit_paused) for s in status.streams] == [[DISK_BUDGET]]
            scrape = generate_latest(server.registry).decode()
            assert 'sluice_credit_paused{reason="disk_budget",stream="s"} 1.0' in scrape
            promtool = shutil.which("promtool")
            if promtool is not None:
                checked = await asyncio.to_thread(
                    subprocess.run,
                    [promtool, "check", "metrics"],
                    input=scrape.encode(),
                    capture_output=True,
                    check=False,
                )
                assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()
            # nothing accepted is lost: everything taken is stored, in order, and acked
            stored = spark.stored()
            assert stored == sent[: len(stored)]
            assert receiver.stats.records_received == len(stored)
            await wait_until(lambda: producer.acked == len(stored))
            # Spark commits (from its own store, as from its own process): room returns, ingestion resumes
            deadline = time.monotonic() + 60
            while producer.acked < len(sent):
                assert time.monotonic() < deadline, f"only {producer.acked} of {len(sent)} acked"
                spark.commit()
                await asyncio.sleep(0.05)
            await asyncio.wait_for(sending, 30)
            await producer.flush(timeout=30)
        spark.commit()
        assert spark.consumed == sent  # each record once, in order
        assert receiver.stats.credit_pauses[DISK_BUDGET] >= 2
        assert "stream 's': credit resumed after" in caplog.text
        await wait_until(lambda: DISK_BUDGET not in receiver.paused)
        assert paused_metric(server, DISK_BUDGET) == 0
        seconds = server.registry.get_sample_value(
            "sluice_credit_paused_seconds_total", {"stream": "s", "reason": DISK_BUDGET}
        )
        assert seconds is not None and seconds > 0.3


async def test_a_store_over_the_disk_budget_at_start_grants_nothing_until_spark_releases(
    tmp_path: Path,
) -> None:
    earlier = WalBlockStore(tmp_path / "blocks", fsync=FsyncPolicy.off())
    for seq in range(5):  # left by an earlier run: 500 KB, Spark not caught up
        earlier.write("s", seq, seq * 100, 0, [batch(*records(f"e{seq}-", 100, 1_000))])
    earlier.close()
    async with running_server(tmp_path, disk_budget_bytes=100_000, disk_poll_interval=0.05) as server:
        receiver = server.receivers["s"]
        assert DISK_BUDGET in receiver.paused  # measured before the first grant
        async with Producer(server.target, "s", linger=0, producer_id="late") as producer:
            await asyncio.sleep(0.3)
            assert producer.credit == 0
            assert receiver.stats.credit_granted == 0
            spark = Spark(server.config.blocks_dir)
            assert spark.commit() == 5  # one segment, the newest: the server drops it itself
            await wait_until(lambda: producer.credit > 0)
            await producer.send_many([b"after"] * 10)
            await producer.flush(timeout=30)
        assert spark.stored() == [b"after"] * 10
        assert [b.seq for b in spark.store.blocks("s")] == [5]  # numbering continues


async def test_a_disk_budget_below_the_logs_bookkeeping_slows_intake_but_never_stalls(tmp_path: Path) -> None:
    """`sluice config set disk-budget=1` was taken, and then intake stalled for good: the block log's
    bookkeeping (released.json, which no release frees) counted against the budget. Only the blocks
    count: a block at a time, Spark's commits bring credit back every time."""
    credit = {"buffer_records": 400, "prefetch": 200, "low_tide": 50}  # each round needs new credit
    async with running_server(tmp_path, disk_poll_interval=0.05, **credit) as server:
        spark = Spark(server.config.blocks_dir)
        async with Producer(server.target, "s", linger=0, producer_id="p") as producer:
            await producer.send_many([b"before"] * 1_000)
            await producer.flush(timeout=30)
            spark.commit()
            server.change_settings({"disk-budget": "1"})  # as `sluice config set disk-budget=1`
            assert (tmp_path / "blocks" / "s" / "released.json").stat().st_size > 1
            for n in range(1, 4):
                await producer.send_many([b"round %d" % n] * 300)
                deadline = time.monotonic() + 30
                while producer.acked < 1_000 + 300 * n:
                    assert time.monotonic() < deadline, f"round {n}: only {producer.acked} acked, stalled"
                    spark.commit()  # Spark's, from its own process: releases what it read
                    await asyncio.sleep(0.05)
        spark.commit()
        assert spark.consumed == [b"before"] * 1_000 + [
            b"round %d" % n for n in range(1, 4) for _ in range(300)
        ]


def test_trim_drops_a_fully_released_newest_segment_and_keeps_the_producers(tmp_path: Path) -> None:
    writer = WalBlockStore(tmp_path, fsync=FsyncPolicy.off())
    writer.write("s", 0, 0, 0, [batch(b"a", b"b")], {"p": 2})
    writer.write("s", 1, 2, 0, [batch(b"c")], {"q": 7})
    assert writer.trim("s") == 0  # nothing released yet
    spark = WalBlockStore(tmp_path, fsync=FsyncPolicy.off())
    assert spark.release("s", 1) == 1
    assert writer.trim("s") == 0  # block 1 is not released
    assert spark.release("s", 2) == 1
    assert writer.disk_bytes("s") > 200  # release() keeps the newest segment
    freed = writer.trim("s")
    assert freed > 0
    assert not list((tmp_path / "s").glob("*.wal"))
    assert writer.disk_bytes("s") < 200  # released.json only
    assert spark.blocks("s") == []
    writer.write("s", 2, 3, 0, [batch(b"d")], {"p": 3})
    assert [b.seq for b in spark.blocks("s")] == [2]
    writer.close()
    reopened = WalBlockStore(tmp_path)
    assert reopened.recover("s") == (3, 4)
    assert reopened.producers("s") == {"p": 3, "q": 7}
    assert writer.trim("other") == 0


# ---- a full disk ---------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs: writes hit a real ENOSPC. Skipped where mounting is not permitted."""
    yield from _tmpfs(tmp_path / "disk", "2m")


@pytest.fixture
def disk_12m(tmp_path: Path) -> Iterator[Path]:
    """A 12 MiB tmpfs, room for fillers and a few MB of blocks. Skipped where mounting is not permitted."""
    yield from _tmpfs(tmp_path / "disk", "12m")


def _tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    mount_point.mkdir()
    try:
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a small tmpfs for a real disk-full test: {exc}")
    if result.returncode != 0:
        pytest.skip(
            "cannot mount a small tmpfs for a real disk-full test (needs root or CAP_SYS_ADMIN): "
            + result.stderr.decode(errors="replace").strip()
        )
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, check=False)


async def test_a_full_disk_pauses_credit_and_ingestion_resumes_when_room_returns(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="receivers.receiver")
    filler = small_disk / "filler"
    fill(filler, 2 * 1024 * 1024 - 250 * 1024)  # leave about 250 KiB free
    sent = records("f", 1_000, 1_000)  # about 1 MB: far more than is free
    async with running_server(small_disk / "data", buffer_records=600, prefetch=200, low_tide=50) as server:
        receiver = server.receivers["s"]
        async with Producer(server.target, "s", linger=0, batch_size=50, producer_id="full") as producer:
            sending = asyncio.create_task(producer.send_many(sent))
            await wait_until(lambda: DISK_ERROR in receiver.paused)
            await wait_until(lambda: receiver.credit_outstanding == 0)
            granted = receiver.stats.credit_granted
            errors = receiver.stats.block_write_errors
            await asyncio.sleep(0.3)
            assert receiver.stats.credit_granted == granted  # no credit while writes fail
            assert receiver.stats.block_write_errors > errors  # retried, still failing
            assert producer.sent < len(sent)
            assert paused_metric(server, DISK_ERROR) == 1
            assert "credit paused: writing block" in caplog.text
            assert "No space left on device" in caplog.text
            # what is acked is stored; what is taken and not stored waits in memory
            stored = Spark(server.config.blocks_dir).stored()
            assert stored == sent[: len(stored)]
            assert producer.acked == len(stored)
            assert receiver.stats.records_received == len(stored) + receiver.buffered_records
            assert receiver.buffered_records > 0
            os.unlink(filler)  # room returns
            await asyncio.wait_for(sending, 30)
            await producer.flush(timeout=30)
            assert producer.acked == len(sent)
        assert DISK_ERROR not in receiver.paused
        assert paused_metric(server, DISK_ERROR) == 0
        assert receiver.stats.credit_pauses[DISK_ERROR] == 1  # once per transition, not per retry
        assert caplog.text.count("credit paused: writing block") == 1
        assert "credit resumed after" in caplog.text
        assert Spark(server.config.blocks_dir).stored() == sent  # nothing lost, nothing doubled
    with contextlib.suppress(FileNotFoundError):
        filler.unlink()


def free_space(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


async def settled(receiver: Any, quiet: float = 1.5) -> int:
    """Records acked once none more were for `quiet` seconds (three block intervals of 0.5 s)."""
    last, since = -1, time.monotonic()
    while time.monotonic() - since < quiet:
        if receiver.stats.records_acked != last:
            last, since = receiver.stats.records_acked, time.monotonic()
        await asyncio.sleep(0.02)
    return int(last)


def by_prefix(values: list[bytes], prefix: bytes) -> list[bytes]:
    return [v for v in values if v.startswith(prefix)]


async def test_a_block_larger_than_the_free_disk_is_written_in_parts_as_room_allows(
    disk_12m: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A block larger than the free disk was retried whole every block interval: with 2 MiB free a
    6 MB block kept its stream paused for good, and 3 MiB more freed did not help either (it took 6).
    A write that fails for lack of room is retried at once in smaller blocks (whole messages), so what
    fits is made durable and acked, and the rest follows as room returns: in order, none lost or
    doubled, the producer's dedup mark right, the memory budget kept, one ERROR and one pause."""
    caplog.set_level(logging.DEBUG, logger="receivers.receiver")
    room_later, more_room = disk_12m / "filler-a", disk_12m / "filler-b"
    fill(room_later, 3 * MIB)
    fill(more_room, 7 * MIB)  # 2 MiB left
    size, batch_size = 10_000, 20  # a message (one chunk of a block) of 200 kB
    message = size * batch_size
    # two producers (one named, one with the SDK's random id), 300 records of 10 kB each: 6 MB together
    named, anonymous = records("n", 300, size), records("a", 300, size)
    budget = 32 * MIB  # blocks seal at a quarter: 8 MiB, more than all of it; the interval seals
    async with running_server(
        disk_12m / "data",
        block_interval=0.5,
        block_linger=None,
        buffer_records=2_000,
        prefetch=1_000,
        buffer_bytes=budget,
    ) as server:
        receiver = server.receivers["s"]
        most_buffered = Peak(lambda: receiver.buffered_bytes, every=0.005)
        async with (
            Producer(server.target, "s", linger=0, batch_size=batch_size, producer_id="named") as first,
            Producer(server.target, "s", linger=0, batch_size=batch_size) as second,
        ):
            # credit for all of it (1,000 records a session): sent before the first block seals
            await asyncio.wait_for(asyncio.gather(first.send_many(named), second.send_many(anonymous)), 30)
            await wait_until(lambda: DISK_ERROR in receiver.paused)
            written = await settled(receiver)
            # what fits is durable and acked: the disk is full to less than a message's frame
            assert free_space(disk_12m) < 2 * message, (free_space(disk_12m), written)
            assert written >= 150, written  # about 2 MiB of 10 kB records
            assert written < 600 and DISK_ERROR in receiver.paused
            await wait_until(lambda: first.acked + second.acked == written)
            stored = Spark(server.config.blocks_dir).stored()
            assert len(stored) == written
            assert by_prefix(stored, b"n") == named[: first.acked]
            assert by_prefix(stored, b"a") == anonymous[: second.acked]

            room_later.unlink()  # 3 MiB more: not enough for the rest (about 3.8 MiB), enough for most
            more = await settled(receiver)
            assert free_space(disk_12m) < 2 * message, (free_space(disk_12m), more)
            assert written + 250 <= more < 600, (written, more)
            assert DISK_ERROR in receiver.paused

            more_room.unlink()  # room for all of it
            await first.flush(timeout=30)
            await second.flush(timeout=30)
            assert first.acked == len(named) and second.acked == len(anonymous)
            assert DISK_ERROR not in receiver.paused
        most_buffered.stop()
        assert most_buffered.value <= budget
        assert receiver.buffered_records == 0 and receiver.buffered_bytes == 0 and server.memory.held == 0
        spark = Spark(server.config.blocks_dir)
        stored = spark.stored()
        assert by_prefix(stored, b"n") == named and by_prefix(stored, b"a") == anonymous
        blocks = spark.store.blocks("s")
        assert [b.seq for b in blocks] == list(range(blocks[0].seq, blocks[0].seq + len(blocks)))
        assert all(b.first_offset == a.first_offset + a.count for a, b in itertools.pairwise(blocks))
        assert blocks[0].first_offset == 0 and sum(b.count for b in blocks) == 600
        state = receiver.producer("named")
        assert state is not None and state.durable_up_to == state.accepted_up_to == 300
        assert receiver.stats.credit_pauses[DISK_ERROR] == 1
    marks = {"named": 300, second.producer_id: 300}  # each producer's dedup mark, from the log
    assert WalBlockStore(disk_12m / "data" / "blocks").producers("s") == marks
    said = [r for r in caplog.records if r.name == "receivers.receiver"]
    errors = [r.getMessage() for r in said if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "No space left on device" in errors[0], errors
    paused = [r for r in said if "credit paused: writing block" in r.getMessage()]
    assert len(paused) == 1 and paused[0].levelno == logging.WARNING
    assert sum("credit resumed after" in r.getMessage() for r in said) == 1


class _Quota:
    """A store's write that refuses blocks of more than `room` messages with `code` (a quota cannot be
    filled here: root passes quotas), or every write with it while `failing` (EIO: a broken disk).
    A block with records of the producer `poison` is refused first, as data the log cannot hold (what
    the edge validation prevents on the real log). Keeps the number of messages of each write it was
    given."""

    def __init__(
        self, receiver: Any, code: int, room: int | None = None, failing: int = 0, poison: str | None = None
    ) -> None:
        self.write, self.code, self.room, self.failing = receiver.store.write, code, room, failing
        self.poison = poison
        self.sizes: list[int] = []
        self.first_takes = 0.0  # seconds the first write takes
        receiver.store.write = self

    def __call__(self, *args: Any) -> Any:
        self.sizes.append(len(args[4]))
        if len(self.sizes) == 1:
            time.sleep(self.first_takes)
        if self.poison is not None and self.poison in (args[5] or {}):
            raise OverflowError(f"producer {self.poison!r}: this log cannot hold its mark")
        if self.failing or (self.room is not None and len(args[4]) > self.room):
            self.failing = max(0, self.failing - 1)
            raise OSError(self.code, os.strerror(self.code))
        return self.write(*args)


@pytest.mark.parametrize("code", [errno.EDQUOT, errno.ENOSPC])
async def test_a_block_over_the_quota_is_cut_down_to_what_fits(tmp_path: Path, code: int) -> None:
    async with running_server(tmp_path, block_interval=1.0, block_linger=None) as server:
        receiver = server.receivers["s"]
        quota = _Quota(receiver, code, room=3)
        sent = records("q", 200, 100)
        async with Producer(server.target, "s", linger=0, batch_size=10) as producer:
            await producer.send_many(sent)  # 20 messages, well within a block interval
            await producer.flush(timeout=30)
            # 20 messages refused, then 10, then 5; then 2 at a time (5's half: it does not grow in
            # the seal that cut it), all in the same seal; then blocks are of normal size again
            assert quota.sizes == [20, 10, 5] + [2] * 10, quota.sizes
            assert receiver.stats.block_write_errors == 3
            assert DISK_ERROR not in receiver.paused and receiver.stats.credit_pauses[DISK_ERROR] == 1
            quota.room = None
            before = len(quota.sizes)
            await producer.send_many(sent)
            await producer.flush(timeout=30)
            assert quota.sizes[before:] == [20], quota.sizes
        assert receiver.stats.block_write_errors == 3
        assert Spark(server.config.blocks_dir).stored() == sent * 2


async def test_credit_resumes_only_once_the_block_prepared_ahead_is_written_in_parts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The block prepared during a write (records taken after the seal began) failed for lack of room:
    one part of it was written and credit resumed with the rest of it still pending, to pause again at
    the next seal. Credit resumes once every record of the failed block is durable."""
    async with running_server(tmp_path, block_interval=1.0, block_linger=None, block_records=50) as server:
        receiver = server.receivers["s"]
        quota = _Quota(receiver, errno.ENOSPC)
        quota.first_takes = 0.3  # the rest piles up meanwhile: the next block is prepared ahead
        end_at_resume: list[int] = []
        failed_end: list[int] = []

        class Resumed(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "credit resumed" in record.getMessage():
                    end_at_resume.append(receiver.log_end[1])

        def refused(*args: Any) -> Any:
            quota.room = 3 if quota.sizes else None  # room for the first block, and 3 messages then
            try:
                return quota(*args)
            except OSError:
                failed_end.append(args[2] + sum(b.num_rows for b in args[4]))
                raise

        receiver.store.write = refused
        caplog.set_level(logging.INFO, logger="receivers.receiver")
        handler = Resumed()
        logging.getLogger("receivers.receiver").addHandler(handler)
        try:
            sent = records("r", 200, 100)
            async with Producer(server.target, "s", linger=0, batch_size=10) as producer:
                await producer.send_many(sent)  # 20 messages; a block's worth is 5 (50 records)
                await producer.flush(timeout=30)
        finally:
            logging.getLogger("receivers.receiver").removeHandler(handler)
        assert quota.sizes[:3] == [5, 5, 2], quota.sizes  # block 1, prepared ahead, is refused
        assert end_at_resume and failed_end, (end_at_resume, failed_end)
        assert end_at_resume[0] >= failed_end[0], (end_at_resume, failed_end, quota.sizes)
        assert Spark(server.config.blocks_dir).stored() == sent


async def test_records_written_apart_after_a_data_error_are_cut_down_to_what_fits(tmp_path: Path) -> None:
    """After a block the log cannot hold (one producer's data), each producer's records are written as a
    block of their own. One of those that failed for lack of room ended the seal: it and every producer's
    records after it waited a block interval (30 s here), paused, for a retry. It is cut down to what fits
    at once, as any block is: the other producers' records are durable and acked in the same seal, the
    poisoned producer's refused, none lost or doubled, and credit resumes."""
    # a long interval: the records wait for seal_now(), in one block
    async with running_server(
        tmp_path, block_interval=30.0, block_linger=None, buffer_records=2_000, prefetch=200
    ) as server:
        receiver = server.receivers["s"]
        quota = _Quota(receiver, errno.ENOSPC, room=3, poison="poison")
        good, other, bad = records("g", 100, 100), records("o", 60, 100), records("p", 20, 100)
        poisoned = Producer(server.target, "s", linger=0, batch_size=10, producer_id="poison")
        async with (
            Producer(server.target, "s", linger=0, batch_size=10, producer_id="good") as first,
            Producer(server.target, "s", linger=0, batch_size=10) as second,
        ):
            await poisoned.start()
            try:
                # in this order, in one block: 10 messages, 6, then 2 the log cannot hold
                for producer, sent in ((first, good), (second, other), (poisoned, bad)):
                    buffered = receiver.buffered_records + len(sent)
                    await producer.send_many(sent)
                    await wait_until(lambda: receiver.buffered_records == buffered)  # noqa: B023 - awaited here
                await receiver.seal_now()
                # the block (18 messages) fails on the poisoned producer's records; the good producer's
                # 10 messages, written apart, do not fit: 5, then 2 at a time; then the other's, 2 at a
                # time, and the poisoned producer's 2, which fail on their data alone
                assert quota.sizes == [18, 10, 5] + [2] * 8 + [2, 2], quota.sizes
                stored = Spark(server.config.blocks_dir).stored()
                assert by_prefix(stored, b"g") == good and by_prefix(stored, b"o") == other, stored
                assert not by_prefix(stored, b"p")
                with pytest.raises(RPCError) as refused:
                    await poisoned.flush(timeout=10)
                assert refused.value.status is grpc.StatusCode.INVALID_ARGUMENT, refused.value
                assert "cannot hold" in refused.value.message
            finally:
                await poisoned.abort()
            await wait_until(lambda: first.acked == len(good) and second.acked == len(other))
            assert DISK_ERROR not in receiver.paused and receiver.stats.credit_pauses[DISK_ERROR] == 1
            assert receiver.stats.block_write_errors == 2
            assert receiver.stats.records_acked == 160 and receiver.stats.records_not_accepted == 20
            assert receiver.buffered_records == 0 and receiver.buffered_bytes == 0
            # credit flows (more than a session's prefetch is taken), and blocks are written again
            quota.room = None
            granted = receiver.stats.credit_granted
            more = records("m", 300, 100)
            await first.send_many(more)
            await wait_until(lambda: receiver.buffered_records == len(more))
            assert receiver.stats.credit_granted > granted
            await receiver.seal_now()
            await first.flush(timeout=10)
            assert first.acked == len(good) + len(more)
        spark = Spark(server.config.blocks_dir)
        stored = spark.stored()
        assert by_prefix(stored, b"g") == good and by_prefix(stored, b"o") == other
        assert by_prefix(stored, b"m") == more and not by_prefix(stored, b"p")
        blocks = spark.store.blocks("s")
        assert blocks[0].first_offset == 0 and sum(b.count for b in blocks) == 460
        assert all(b.first_offset == a.first_offset + a.count for a, b in itertools.pairwise(blocks))
        state = receiver.producer("good")
        assert state is not None and state.durable_up_to == state.accepted_up_to == 400
        assert receiver.stats.records_acked == 460
    assert WalBlockStore(tmp_path / "blocks").producers("s") == {"good": 400, second.producer_id: 60}


async def test_another_write_error_retries_the_whole_block(tmp_path: Path) -> None:
    """An I/O error says nothing of what a smaller block would meet: the block is retried whole, at the
    block interval, as before."""
    async with running_server(tmp_path, block_interval=0.3, block_linger=None) as server:
        receiver = server.receivers["s"]
        quota = _Quota(receiver, errno.EIO, failing=3)
        sent = records("e", 200, 100)
        async with Producer(server.target, "s", linger=0, batch_size=10) as producer:
            await producer.send_many(sent)
            await producer.flush(timeout=30)
        assert quota.sizes[:4] == [20] * 4, quota.sizes
        assert receiver.stats.block_write_errors == 3
        assert Spark(server.config.blocks_dir).stored() == sent


async def test_a_dead_receiver_lets_go_of_its_share_of_the_servers_budget(tmp_path: Path) -> None:
    """A block generator that died (the receiver fails its sessions) left its records counted in the
    server's budget for good: had they filled it, every stream would have stopped reading."""
    async with running_server(
        tmp_path, "a", "b", memory_budget_bytes=64 * 1024 * 1024, block_interval=30.0, block_linger=None
    ) as server:
        dying = server.receivers["a"]
        producer = Producer(server.target, "a", linger=0)
        await producer.start()
        await producer.send_many(records("d", 100, 1_000))
        await wait_until(lambda: dying.buffered_records == 100)  # pending: no seal for 30 s
        assert server.memory.held > 0

        def broken() -> Any:
            raise RuntimeError("a bug in the block generator")

        dying._take_pending = broken  # type: ignore[method-assign]
        dying._seal_wanted.set()
        await wait_until(lambda: dying._stopping)
        assert server.memory.held == 0 and server.memory.members == 1
        await producer.abort()
