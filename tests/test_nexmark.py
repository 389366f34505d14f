"""Nexmark on Sluice: the generator's rules, a push through a real server, and each query on a real Spark
session over a real block store, compared with the same query computed in plain Python."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from ingest.nexmark.generator import (
    AUCTION,
    BID,
    FIRST_AUCTION_ID,
    FIRST_PERSON_ID,
    PERSON,
    Auction,
    Bid,
    Event,
    GeneratorConfig,
    Person,
    date_time_text,
    generate,
    parse_date_time,
    push,
)
from receivers.block import PLAIN_SCHEMA
from receivers.config import FsyncPolicy
from receivers.wal import WalBlockStore
from tests.support import running_server

STREAM = "nexmark"
BASE_MS = 1_700_000_003_000  # 2023-11-14T22:13:23Z: windows start before the first event
N = 3000
EPS = 100.0  # event-time rate: 3000 events span 30 s of event time
CONFIG = GeneratorConfig(seed=7, base_time_ms=BASE_MS, events_per_second=EPS)
WINDOW_MS, SLIDE_MS, TUMBLE_MS = 10_000, 2_000, 10_000  # queries.Windows' defaults


# ---- the generator ----------------------------------------------------------------------------------


def test_proportions_are_1_3_46_in_every_50() -> None:
    events = generate(5000, CONFIG)
    assert Counter(e.event_type for e in events) == {PERSON: 100, AUCTION: 300, BID: 4600}
    for start in range(0, 5000, 50):
        kinds = [e.event_type for e in events[start : start + 50]]
        assert kinds == [PERSON] + [AUCTION] * 3 + [BID] * 46
    assert [e.number for e in events] == list(range(5000))


def test_deterministic_given_the_seed() -> None:
    first = [e.encode() for e in generate(2000, CONFIG)]
    again = [e.encode() for e in generate(2000, CONFIG)]
    other = [e.encode() for e in generate(2000, GeneratorConfig(seed=8, base_time_ms=BASE_MS))]
    assert first == again
    assert first != other
    # a later run continues the sequence where an earlier one stopped
    cont = GeneratorConfig(seed=7, base_time_ms=BASE_MS, events_per_second=EPS, first_event=1000)
    tail = generate(1000, cont)
    assert [e.number for e in tail] == list(range(1000, 2000))
    assert [e.date_time for e in tail] == [e.date_time for e in generate(2000, CONFIG)[1000:]]


def test_ids_are_dense_and_references_point_at_earlier_events() -> None:
    events = generate(60_000, CONFIG)  # past 1000 people: the active set slides
    people: set[int] = set()
    auctions: set[int] = set()
    next_person, next_auction = FIRST_PERSON_ID, FIRST_AUCTION_ID
    hot_auction_bids = 0
    for e in events:
        if e.person is not None:
            assert e.person.id == next_person
            next_person += 1
            people.add(e.person.id)
        elif e.auction is not None:
            a = e.auction
            assert a.id == next_auction
            next_auction += 1
            assert a.seller in people, f"auction {a.id}'s seller {a.seller} does not exist yet"
            assert a.dateTime < a.expires
            assert a.reserve > a.initialBid > 0
            assert 10 <= a.category < 15
            auctions.add(a.id)
        else:
            assert e.bid is not None
            assert e.bid.auction in auctions, f"bid {e.number}'s auction {e.bid.auction} does not exist yet"
            assert e.bid.bidder in people, f"bid {e.number}'s bidder {e.bid.bidder} does not exist yet"
            assert 100 <= e.bid.price <= 100_000_000
            hot_auction_bids += (e.bid.auction - FIRST_AUCTION_ID) % 100 == 0
    bids = sum(e.event_type == BID for e in events)
    # half the bids go to the hot auction, the rest mostly elsewhere among the last 100
    assert 0.45 < hot_auction_bids / bids < 0.6


def test_event_time_and_encoding() -> None:
    events = generate(200, CONFIG)
    assert [e.date_time for e in events] == [BASE_MS + i * 10 for i in range(200)]
    values = [json.loads(e.encode()) for e in events[:5]]
    assert [v["event_type"] for v in values] == [0, 1, 1, 1, 2]
    person, auction, bid = values[0]["person"], values[1]["auction"], values[4]["bid"]
    assert values[0]["auction"] is None and values[0]["bid"] is None
    assert list(person) == ["id", "name", "emailAddress", "creditCard", "city", "state", "dateTime", "extra"]
    assert list(auction) == [
        "id", "itemName", "description", "initialBid", "reserve", "dateTime", "expires", "seller",
        "category", "extra",
    ]  # fmt: skip
    assert list(bid) == ["auction", "bidder", "price", "channel", "url", "dateTime", "extra"]
    assert bid["dateTime"] == "2023-11-14T22:13:23.040Z"
    assert parse_date_time(bid["dateTime"]) == BASE_MS + 40
    assert date_time_text(BASE_MS + 7) == "2023-11-14T22:13:23.007Z"
    assert {e.key for e in events} == {b"person", b"auction", b"bid"}


async def test_push_through_a_real_server_lands_every_event_in_the_block_log(tmp_path: Path) -> None:
    expected = [e.encode() for e in generate(N, CONFIG)]
    async with running_server(tmp_path, STREAM) as server:
        result = await push(server.target, STREAM, N, config=CONFIG, chunk=500)
        assert (result.acked, result.events, result.next_event) == (N, N, N)
        stored: list[tuple[bytes, bytes]] = []
        deadline = time.monotonic() + 30
        while len(stored) < N and time.monotonic() < deadline:
            stored = [
                (key, value)
                for block in server.store.blocks(STREAM)
                for batch in server.store.read(block)
                for key, value in zip(
                    batch.column("key").to_pylist(), batch.column("value").to_pylist(), strict=True
                )
            ]
            if len(stored) < N:
                await asyncio.sleep(0.05)
    assert [v for _, v in stored] == expected  # every event once, in order
    assert Counter(k for k, _ in stored) == {
        b"bid": N * 46 // 50,
        b"auction": N * 3 // 50,
        b"person": N // 50,
    }


# ---- the queries on Spark ---------------------------------------------------------------------------


def write_events(store: WalBlockStore, events: list[Event], block: int = 500) -> None:
    """Append the events' records to the stream's block log, `block` records a block."""
    for start in range(0, len(events), block):
        part = events[start : start + block]
        seq, offset = store.recover(STREAM)
        batch = pa.RecordBatch.from_arrays(
            [
                pa.array([e.key for e in part], pa.binary()),
                pa.array([e.encode() for e in part], pa.binary()),
                pa.array([BASE_MS * 1000] * len(part), pa.timestamp("us", tz="UTC")),
            ],
            schema=PLAIN_SCHEMA,
        )
        store.write(STREAM, seq, offset, 0, [batch])


def closing_events(after_ms: int) -> list[Event]:
    """A person, an auction and a bid far later in event time, matching nothing: they move the
    watermark past every window of the data, so append mode emits them."""
    t = after_ms + 60_000
    return [
        Event(-1, PERSON, person=Person(1, "late", "", "", "", "", t, "")),
        Event(-1, AUCTION, auction=Auction(2, "", "", 1, 2, t, t + 1, 3, 10, "")),
        Event(-1, BID, bid=Bid(1, 1, 1, "", "", t, "")),
    ]


def run_query(
    spark: Any,
    tmp_path: Path,
    name: str,
    events: list[Event],
    columns: Iterable[str],
    expected_rows: int,
    *,
    windowed: bool = False,
) -> list[tuple[Any, ...]]:
    """Run Nexmark query `name` over `events` (and, for windowed queries, closing events after them);
    return the sink's rows once it holds expected_rows (timestamps as epoch milliseconds)."""
    from ingest.nexmark.queries import QUERIES
    from ingest.spark.pipeline import PipelineContext, start_query

    store = WalBlockStore(tmp_path / "blocks", fsync=FsyncPolicy.off())
    sink = tmp_path / "sink"
    write_events(store, events)
    query = start_query(
        spark,
        store_root=tmp_path / "blocks",
        streams=[STREAM],
        pipeline=QUERIES[name],
        checkpoint_dir=tmp_path / "checkpoint",
        trigger_seconds=0.2,
        query_name=f"nexmark-{name}-test",
        context=PipelineContext(sink_dir=sink, streams=(STREAM,)),
    )
    try:
        query.processAllAvailable()
        rows = read_sink(spark, sink, columns)
        closing = closing_events(max(e.date_time for e in events))
        deadline = time.monotonic() + 60
        while windowed and len(rows) < expected_rows and time.monotonic() < deadline:
            # each closing batch moves the watermark on; the batch after it emits the closed windows
            write_events(store, closing)
            query.processAllAvailable()
            rows = read_sink(spark, sink, columns)
        assert query.exception() is None, query.exception()
        assert query.isActive
    finally:
        query.stop()
    return rows


def read_sink(spark: Any, sink: Path, columns: Iterable[str]) -> list[tuple[Any, ...]]:
    if not (sink / "_spark_metadata").is_dir():
        return []
    df = spark.read.parquet(str(sink))
    exprs = [
        f"unix_millis({c}) AS {c}" if dict(df.dtypes)[c] == "timestamp" else c for c in columns
    ]  # naive datetimes would depend on the time zone
    return [tuple(r) for r in df.selectExpr(*exprs).collect()]


def bids(events: list[Event]) -> list[tuple[int, Bid]]:
    return [(i, e.bid) for i, e in enumerate(events) if e.bid is not None]


@pytest.fixture(scope="module")
def events() -> list[Event]:
    return generate(N, CONFIG)


@pytest.mark.spark
def test_q0_passes_every_event_through_once(spark: Any, tmp_path: Path, events: list[Event]) -> None:
    rows = run_query(spark, tmp_path, "q0", events, ["source_offset", "event_type", "dateTime"], N)
    assert sorted(rows) == [(i, e.event_type, e.date_time) for i, e in enumerate(events)]


@pytest.mark.spark
def test_q1_converts_every_bid_once(spark: Any, tmp_path: Path, events: list[Event]) -> None:
    expected = sorted(
        (i, b.auction, b.bidder, Decimal(b.price) * Decimal("0.908"), b.dateTime) for i, b in bids(events)
    )
    columns = ["source_offset", "auction", "bidder", "price", "dateTime"]
    rows = run_query(spark, tmp_path, "q1", events, columns, len(expected))
    assert sorted(rows) == expected


@pytest.mark.spark
def test_q2_selects_bids_on_auctions_divisible_by_123(
    spark: Any, tmp_path: Path, events: list[Event]
) -> None:
    expected = sorted((i, b.auction, b.price) for i, b in bids(events) if b.auction % 123 == 0)
    assert len(expected) >= 3  # auction 1107 is among the last hundred for a while
    rows = run_query(spark, tmp_path, "q2", events, ["source_offset", "auction", "price"], len(expected))
    assert sorted(rows) == expected


@pytest.mark.spark
def test_q5_hot_items_per_sliding_window(spark: Any, tmp_path: Path, events: list[Event]) -> None:
    counts: dict[int, Counter[int]] = defaultdict(Counter)
    for _, b in bids(events):
        last_start = b.dateTime - b.dateTime % SLIDE_MS
        for start in range(last_start, b.dateTime - WINDOW_MS, -SLIDE_MS):
            counts[start][b.auction] += 1
    expected = sorted(
        (start, start + WINDOW_MS, auction, n)
        for start, per_auction in counts.items()
        for auction, n in per_auction.items()
        if n == max(per_auction.values())
    )
    assert len(expected) >= 15
    columns = ["window_start", "window_end", "auction", "num"]
    rows = run_query(spark, tmp_path, "q5", events, columns, len(expected), windowed=True)
    assert sorted(rows) == expected


@pytest.mark.spark
def test_q7_highest_bid_per_tumbling_window(spark: Any, tmp_path: Path, events: list[Event]) -> None:
    top: dict[int, tuple[int, int, int, int, int]] = {}
    for i, b in bids(events):
        start = b.dateTime - b.dateTime % TUMBLE_MS
        top[start] = max(top.get(start, (-1, 0, 0, 0, 0)), (b.price, b.auction, b.bidder, b.dateTime, i))
    expected = sorted((start, start + TUMBLE_MS, *best) for start, best in top.items())
    assert len(expected) >= 3
    columns = ["window_start", "window_end", "price", "auction", "bidder", "dateTime", "source_offset"]
    rows = run_query(spark, tmp_path, "q7", events, columns, len(expected), windowed=True)
    assert sorted(rows) == expected


@pytest.mark.spark
def test_q8_new_users_who_opened_an_auction_in_their_window(
    spark: Any, tmp_path: Path, events: list[Event]
) -> None:
    def window(t: int) -> int:
        return t - t % TUMBLE_MS

    sellers = {(e.auction.seller, window(e.auction.dateTime)) for e in events if e.auction is not None}
    expected = sorted(
        (p.id, p.name, window(p.dateTime), window(p.dateTime) + TUMBLE_MS)
        for p in (e.person for e in events)
        if p is not None and (p.id, window(p.dateTime)) in sellers
    )
    assert len(expected) >= 3
    columns = ["id", "name", "window_start", "window_end"]
    rows = run_query(spark, tmp_path, "q8", events, columns, len(expected), windowed=True)
    assert sorted(rows) == expected
