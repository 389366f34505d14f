"""Nexmark events (Person, Auction, Bid) and pushing them to a Sluice stream through the client SDK.

The rules are those of the standard Nexmark generator (Apache Beam's and Flink's nexmark, re-implemented
here): event number n is a person, an auction or a bid by n mod 50 (1 person, 3 auctions, 46 bids);
person and auction ids are dense from 1000 (the k-th person has id 1000 + k); an auction's seller is, with
probability 3/4, the "hot" seller (the first person of the last block of 100) and otherwise one of the
last 1000 people; a bid's auction is, with probability 1/2, the hot auction (the first of the last block
of 100 auctions) and otherwise one of the last 100 auctions; its bidder, with probability 3/4, the hot
bidder (the second person of the last block of 100) and otherwise one of the last 1000 people. Prices
are round(10^(6u) * 100) cents, u uniform in [0, 1). An auction expires after a random length averaging
the event-time span in which 100 more auctions arrive. `extra` pads each event to an average target size.

Two deliberate departures, both so that every reference points at an event generated earlier (a query
joining bids with auctions and people finds them all): the standard generator draws random ids up to 10
beyond the last one (its "leads": ids of events not generated yet), here the leads default to 0
(GeneratorConfig.id_lead); and the standard hot bidder (last block's first person + 1) may not exist yet
when its block has only one person, here it is then that person.

Event time: event n has dateTime = base time + n / events_per_second (milliseconds, rounded down), so
windowed queries see time advance at that rate whatever the speed of the push. Deterministic given the
seed, the base time and the sizes: the same configuration gives the same events, byte for byte.

Encoding: one Sluice record per event, key b"person" / b"auction" / b"bid", value the JSON of Flink
nexmark's single table: {"event_type": 0|1|2, "person": {...}|null, "auction": {...}|null, "bid":
{...}|null}, times as ISO-8601 UTC text with milliseconds ("2026-11-24T05:33:28.123Z").

This module is client side: stdlib and sluice_client only (no Spark, no pyarrow).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sluice_client import Producer

PERSON, AUCTION, BID = 0, 1, 2
"""event_type values, as in Flink nexmark's single-table encoding."""
KEYS = {PERSON: b"person", AUCTION: b"auction", BID: b"bid"}

PERSON_PROPORTION, AUCTION_PROPORTION, BID_PROPORTION = 1, 3, 46
TOTAL_PROPORTION = PERSON_PROPORTION + AUCTION_PROPORTION + BID_PROPORTION
FIRST_PERSON_ID = 1000
FIRST_AUCTION_ID = 1000
FIRST_CATEGORY_ID = 10
NUM_CATEGORIES = 5
HOT_SELLER_BLOCK = HOT_AUCTION_BLOCK = HOT_BIDDER_BLOCK = 100
"""Hot sellers, auctions and bidders are taken from the last block of this many ids."""

US_STATES = ("AZ", "CA", "ID", "OR", "WA", "WY")
US_CITIES = (
    "Phoenix", "Los Angeles", "San Francisco", "Boise", "Portland", "Bend", "Redmond", "Seattle", "Kent",
    "Cheyenne",
)  # fmt: skip
FIRST_NAMES = ("Peter", "Paul", "Luke", "John", "Saul", "Vicky", "Kate", "Julie", "Sarah", "Deiter", "Walter")
LAST_NAMES = ("Shultz", "Abrams", "Spencer", "White", "Bartels", "Walton", "Smith", "Jones", "Noris")
HOT_CHANNELS = ("Google", "Facebook", "Baidu", "Apple")
NUM_CHANNELS = 10_000

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_WITH_SPACES = _LETTERS * 12 + " " * 26
"""Drawing from this gives a space with probability 1/13, as nextString does."""
_EXTRA_POOL_CHARS = 1 << 16


def date_time_text(millis: int) -> str:
    """Epoch milliseconds as ISO-8601 UTC text with milliseconds: "2026-11-24T05:33:28.123Z"."""
    seconds, ms = divmod(millis, 1000)
    return f"{_second_text(seconds)}.{ms:03d}Z"


_SECOND_TEXT: dict[int, str] = {}


def _second_text(seconds: int) -> str:
    # formatting a datetime costs microseconds; events of one second share it
    text = _SECOND_TEXT.get(seconds)
    if text is None:
        if len(_SECOND_TEXT) > 4096:
            _SECOND_TEXT.clear()
        text = datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        _SECOND_TEXT[seconds] = text
    return text


def parse_date_time(text: str) -> int:
    """Epoch milliseconds of date_time_text's output."""
    return round(datetime.fromisoformat(text).timestamp() * 1000)


@dataclass(frozen=True)
class GeneratorConfig:
    """What decides the events: the same configuration gives the same events."""

    seed: int = 42
    base_time_ms: int | None = None
    """Event time of event 0, epoch milliseconds; None: the wall clock when the generator is made."""
    events_per_second: float = 10_000.0
    """Event-time rate: event n is n / events_per_second seconds after the base time (Nexmark's
    default first rate is 10,000/s)."""
    first_event: int = 0
    """Number of the first event made: a later run continues a sequence (ids and times) from here."""
    avg_person_bytes: int = 100
    avg_auction_bytes: int = 200
    avg_bid_bytes: int = 48
    """Average sizes `extra` pads to, counted as Nexmark counts (8 bytes a number plus the strings).
    Small by default; the standard's are 200, 500 and 100."""
    num_active_people: int = 1000
    num_in_flight_auctions: int = 100
    hot_auction_ratio: int = 2
    hot_sellers_ratio: int = 4
    hot_bidders_ratio: int = 4
    id_lead: int = 0
    """How far beyond the last id a random person or auction id may go (the standard's is 10: ids of
    events not generated yet). 0 keeps every reference to an earlier event."""

    def __post_init__(self) -> None:
        if self.events_per_second <= 0:
            raise ValueError(f"events_per_second must be > 0, got {self.events_per_second}")
        if self.first_event < 0:
            raise ValueError(f"first_event must be >= 0, got {self.first_event}")
        for name in ("hot_auction_ratio", "hot_sellers_ratio", "hot_bidders_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


@dataclass(frozen=True, slots=True)
class Person:
    id: int
    name: str
    emailAddress: str
    creditCard: str
    city: str
    state: str
    dateTime: int
    extra: str


@dataclass(frozen=True, slots=True)
class Auction:
    id: int
    itemName: str
    description: str
    initialBid: int
    reserve: int
    dateTime: int
    expires: int
    seller: int
    category: int
    extra: str


@dataclass(frozen=True, slots=True)
class Bid:
    auction: int
    bidder: int
    price: int
    channel: str
    url: str
    dateTime: int
    extra: str


@dataclass(frozen=True, slots=True)
class Event:
    """One Nexmark event: exactly one of person, auction, bid is set, as event_type says."""

    number: int
    event_type: int
    person: Person | None = None
    auction: Auction | None = None
    bid: Bid | None = None

    @property
    def date_time(self) -> int:
        """Event time, epoch milliseconds."""
        inner = self.person or self.auction or self.bid
        assert inner is not None
        return inner.dateTime

    @property
    def key(self) -> bytes:
        return KEYS[self.event_type]

    def to_json(self) -> dict[str, Any]:
        """The JSON object of the record's value (Flink nexmark's single table)."""
        person = auction = bid = None
        if self.person is not None:
            p = self.person
            person = {
                "id": p.id, "name": p.name, "emailAddress": p.emailAddress, "creditCard": p.creditCard,
                "city": p.city, "state": p.state, "dateTime": date_time_text(p.dateTime), "extra": p.extra,
            }  # fmt: skip
        elif self.auction is not None:
            a = self.auction
            auction = {
                "id": a.id, "itemName": a.itemName, "description": a.description,
                "initialBid": a.initialBid, "reserve": a.reserve, "dateTime": date_time_text(a.dateTime),
                "expires": date_time_text(a.expires), "seller": a.seller, "category": a.category,
                "extra": a.extra,
            }  # fmt: skip
        elif self.bid is not None:
            b = self.bid
            bid = {
                "auction": b.auction, "bidder": b.bidder, "price": b.price, "channel": b.channel,
                "url": b.url, "dateTime": date_time_text(b.dateTime), "extra": b.extra,
            }  # fmt: skip
        return {"event_type": self.event_type, "person": person, "auction": auction, "bid": bid}

    def encode(self) -> bytes:
        """The record's value: compact JSON, UTF-8."""
        return json.dumps(self.to_json(), separators=(",", ":")).encode()


def event_type_of(number: int) -> int:
    """Which kind event `number` is: 1 in 50 a person, 3 auctions, 46 bids."""
    rem = number % TOTAL_PROPORTION
    if rem < PERSON_PROPORTION:
        return PERSON
    if rem < PERSON_PROPORTION + AUCTION_PROPORTION:
        return AUCTION
    return BID


def last_person(number: int) -> int:
    """The last person id (base 0) made up to event `number`: its own id if it is a person."""
    epoch, offset = divmod(number, TOTAL_PROPORTION)
    return epoch * PERSON_PROPORTION + min(offset, PERSON_PROPORTION - 1)


def last_auction(number: int) -> int:
    """The last auction id (base 0) made up to event `number`: its own id if it is an auction; -1 when
    there is none yet."""
    epoch, offset = divmod(number, TOTAL_PROPORTION)
    if offset < PERSON_PROPORTION:
        epoch, offset = epoch - 1, AUCTION_PROPORTION - 1
    elif offset >= PERSON_PROPORTION + AUCTION_PROPORTION:
        offset = AUCTION_PROPORTION - 1
    else:
        offset -= PERSON_PROPORTION
    return epoch * AUCTION_PROPORTION + offset


class NexmarkGenerator:
    """Makes events first_event, first_event + 1, ... of a configuration, one by one."""

    def __init__(self, config: GeneratorConfig | None = None) -> None:
        self.config = config or GeneratorConfig()
        base = self.config.base_time_ms
        self.base_time_ms = round(time.time() * 1000) if base is None else base
        self.next_number = self.config.first_event
        self._rng = random.Random(self.config.seed)  # noqa: S311 - a benchmark's data, reproducible
        # `extra` is a slice of one random text, as Flink's generator does: random text per event is the
        # costliest part of making an event and says nothing more
        pool = random.Random(self.config.seed ^ 0x5EED)  # noqa: S311
        self._extra_pool = "".join(pool.choices(_LETTERS, k=_EXTRA_POOL_CHARS))
        self._hot_urls = tuple(_base_url(pool) for _ in HOT_CHANNELS)
        self._channel_urls: dict[int, str] = {}
        self._ms_per_event = 1000.0 / self.config.events_per_second
        auctions_horizon = self.config.num_in_flight_auctions * TOTAL_PROPORTION // AUCTION_PROPORTION
        self._auction_horizon_events = auctions_horizon
        """Events until num_in_flight_auctions more auctions are made: an auction lasts twice that
        much event time at most, on average as long."""

    def __iter__(self) -> Iterator[Event]:
        while True:
            yield self.next_event()

    def take(self, n: int) -> list[Event]:
        """The next n events."""
        return [self.next_event() for _ in range(n)]

    def time_of(self, number: int) -> int:
        """Event time of event `number`, epoch milliseconds."""
        return self.base_time_ms + int(number * self._ms_per_event)

    def next_event(self) -> Event:
        n = self.next_number
        self.next_number += 1
        kind = event_type_of(n)
        ts = self.time_of(n)
        if kind == PERSON:
            return Event(n, PERSON, person=self._person(n, ts))
        if kind == AUCTION:
            return Event(n, AUCTION, auction=self._auction(n, ts))
        return Event(n, BID, bid=self._bid(n, ts))

    # ---- the model, as in Nexmark's Person/Auction/BidGenerator -------------------------------------

    def _below(self, n: int) -> int:
        """Uniform in [0, n)."""
        return int(self._rng.random() * n)

    def _person(self, n: int, ts: int) -> Person:
        rng = self._rng
        name = f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
        email = f"{self._string(7)}@{self._string(5)}.com"
        card = " ".join(f"{self._below(10_000):04d}" for _ in range(4))
        city, state = rng.choice(US_CITIES), rng.choice(US_STATES)
        size = 8 + len(name) + len(email) + len(card) + len(city) + len(state)
        extra = self._extra(size, self.config.avg_person_bytes)
        return Person(last_person(n) + FIRST_PERSON_ID, name, email, card, city, state, ts, extra)

    def _auction(self, n: int, ts: int) -> Auction:
        config = self.config
        if self._below(config.hot_sellers_ratio) > 0:
            seller = (last_person(n) // HOT_SELLER_BLOCK) * HOT_SELLER_BLOCK
        else:
            seller = self._random_person(n)
        category = FIRST_CATEGORY_ID + self._below(NUM_CATEGORIES)
        initial = self._price()
        horizon = self.time_of(n + self._auction_horizon_events) - ts
        expires = ts + 1 + self._below(max(horizon * 2, 1))
        name, description = self._string(20), self._string(100)
        reserve = initial + self._price()
        extra = self._extra(8 + len(name) + len(description) + 40, config.avg_auction_bytes)
        return Auction(
            last_auction(n) + FIRST_AUCTION_ID,
            name,
            description,
            initial,
            reserve,
            ts,
            expires,
            seller + FIRST_PERSON_ID,
            category,
            extra,
        )

    def _bid(self, n: int, ts: int) -> Bid:
        config = self.config
        if self._below(config.hot_auction_ratio) > 0:
            auction = (last_auction(n) // HOT_AUCTION_BLOCK) * HOT_AUCTION_BLOCK
        else:
            auction = self._random_auction(n)
        if self._below(config.hot_bidders_ratio) > 0:
            # the second person of the last block, so that hot bidders and hot sellers differ; while
            # that block holds one person only, that one (the standard would name a person to come)
            newest = last_person(n)
            bidder = min((newest // HOT_BIDDER_BLOCK) * HOT_BIDDER_BLOCK + 1, newest)
        else:
            bidder = self._random_person(n)
        price = self._price()
        if self._below(2) > 0:
            i = self._below(len(HOT_CHANNELS))
            channel, url = HOT_CHANNELS[i], self._hot_urls[i]
        else:
            i = self._below(NUM_CHANNELS)
            channel, url = f"channel-{i}", self._channel_url(i)
        extra = self._extra(32, config.avg_bid_bytes)
        return Bid(auction + FIRST_AUCTION_ID, bidder + FIRST_PERSON_ID, price, channel, url, ts, extra)

    def _random_person(self, n: int) -> int:
        """One of the last num_active_people people (plus id_lead beyond), base 0."""
        people = last_person(n) + 1
        active = min(people, self.config.num_active_people)
        return people - active + self._below(active + self.config.id_lead)

    def _random_auction(self, n: int) -> int:
        """One of the last num_in_flight_auctions auctions (plus id_lead beyond), base 0."""
        newest = last_auction(n)
        oldest = max(newest - self.config.num_in_flight_auctions, 0)
        return oldest + self._below(newest - oldest + 1 + self.config.id_lead)

    def _price(self) -> int:
        return round(math.pow(10.0, self._rng.random() * 6.0) * 100.0)

    def _string(self, max_length: int) -> str:
        """Random lowercase text of 3 to max_length - 1 characters, about 1 in 13 a space, trimmed."""
        length = 3 + self._below(max_length - 3)
        return "".join(self._rng.choices(_WITH_SPACES, k=length)).strip()

    def _extra(self, current: int, average: int) -> str:
        """Padding so that current + its length is on average `average` (within +-20 %)."""
        if current > average:
            return ""
        wanted = average - current
        delta = round(wanted * 0.2)
        size = wanted - delta + (self._below(2 * delta) if delta else 0)
        start = self._below(_EXTRA_POOL_CHARS - size)
        return self._extra_pool[start : start + size]

    def _channel_url(self, i: int) -> str:
        url = self._channel_urls.get(i)
        if url is None:
            # per channel, not from the event stream's generator: a channel's url does not depend on
            # which events came before
            rng = random.Random(f"{self.config.seed}:channel:{i}")  # noqa: S311
            url = _base_url(rng)
            if rng.random() < 0.9:
                url += f"&channel_id={i * 2654435761 % 2**31}"
            self._channel_urls[i] = url
        return url


def _base_url(rng: random.Random) -> str:
    def part() -> str:
        return "".join(rng.choices(_LETTERS * 12 + "_" * 26, k=3 + int(rng.random() * 2))).strip("_") or "x"

    return f"https://www.nexmark.com/{part()}/{part()}/{part()}/item.htm?query=1"


def generate(n: int, config: GeneratorConfig | None = None) -> list[Event]:
    """The first n events of `config`."""
    return NexmarkGenerator(config).take(n)


# ---- pushing ---------------------------------------------------------------------------------------


@dataclass
class PushResult:
    events: int
    acked: int
    seconds: float
    """From the first send to the last ack."""
    first_event: int
    next_event: int
    """Number of the event after the last one pushed: a later push continues from it."""
    base_time_ms: int

    @property
    def rate(self) -> float:
        return self.acked / self.seconds if self.seconds > 0 else 0.0


async def push(
    target: str | Sequence[str],
    stream: str,
    events: int,
    *,
    config: GeneratorConfig | None = None,
    generator: NexmarkGenerator | None = None,
    rate: float | None = None,
    chunk: int = 2048,
    flush_timeout: float = 600.0,
    **producer_options: Any,
) -> PushResult:
    """Make `events` events and send them to `stream`; return when all are acked.

    rate: events per second sent (paced by the wall clock); None: as fast as the server's credit (and
    the producer's buffer) allows. `generator` continues an earlier push's sequence; otherwise one is
    made from `config`. producer_options go to sluice_client.Producer.
    """
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    gen = generator or NexmarkGenerator(config)
    first = gen.next_number
    if rate is not None:
        chunk = max(1, min(chunk, int(rate / 100)))  # about 100 sends a second: smooth enough
    async with Producer(target, stream, **producer_options) as producer:
        acked_before = producer.acked
        loop = asyncio.get_running_loop()
        started = loop.time()
        sent = 0
        while sent < events:
            batch = gen.take(min(chunk, events - sent))
            await producer.send_many([e.encode() for e in batch], keys=[e.key for e in batch])
            sent += len(batch)
            if rate is not None:
                ahead = started + sent / rate - loop.time()
                if ahead > 0:
                    await asyncio.sleep(ahead)
        await producer.flush(timeout=flush_timeout)
        seconds = loop.time() - started
        acked = producer.acked - acked_before
    return PushResult(events, acked, seconds, first, gen.next_number, gen.base_time_ms)


def _time_arg(text: str) -> int:
    """Epoch milliseconds from an integer or ISO-8601 text."""
    try:
        return int(text)
    except ValueError:
        moment = datetime.fromisoformat(text)
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return round(moment.timestamp() * 1000)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ingest.nexmark.generator",
        description="Push Nexmark events (persons, auctions, bids) to a Sluice stream.",
    )
    parser.add_argument("--target", required=True, help="HOST:PORT of the Sluice server (or several, a,b)")
    parser.add_argument("--stream", default="nexmark")
    parser.add_argument("--events", type=int, required=True, help="how many events to push")
    parser.add_argument("--rate", type=float, help="events per second to send (default: as fast as credit)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--event-rate",
        type=float,
        help="event-time rate, events per second of dateTime (default: --rate, else 10000)",
    )
    parser.add_argument("--base-time", type=_time_arg, help="dateTime of the first event (epoch ms or ISO)")
    parser.add_argument("--first-event", type=int, default=0, help="continue a sequence from this event")
    parser.add_argument(
        "--sizes",
        default="48,100,200",
        help="average bid, person, auction sizes that `extra` pads to (standard: 100,200,500)",
    )
    args = parser.parse_args(argv)
    try:
        bid_bytes, person_bytes, auction_bytes = (int(x) for x in args.sizes.split(","))
    except ValueError:
        parser.error(f"--sizes wants three integers BID,PERSON,AUCTION, got {args.sizes!r}")
    config = GeneratorConfig(
        seed=args.seed,
        base_time_ms=args.base_time,
        events_per_second=args.event_rate or args.rate or GeneratorConfig.events_per_second,
        first_event=args.first_event,
        avg_bid_bytes=bid_bytes,
        avg_person_bytes=person_bytes,
        avg_auction_bytes=auction_bytes,
    )
    result = asyncio.run(push(args.target, args.stream, args.events, config=config, rate=args.rate))
    print(
        f"acked {result.acked} of {result.events} events in {result.seconds:.2f} s "
        f"({result.rate:,.0f} events/s); next event {result.next_event} (--first-event), "
        f"base time {result.base_time_ms} (--base-time)"
    )
    return 0 if result.acked == result.events else 1


if __name__ == "__main__":
    sys.exit(main())
