"""Nexmark queries Q0, Q1, Q2, Q5, Q7 and Q8 as Sluice pipelines written in Spark SQL.

Each pipeline parses the records' JSON values (ingest.nexmark.generator's encoding) into temporary views
`person`, `auction` and `bid` (and `events`, every event), each with its event time `dateTime` under a
watermark, then runs the query's SQL over them and appends Parquet to the context's sink folder:

    sluice serve --stream nexmark --pipeline ingest.nexmark.queries:q5

The SQL texts (SQL, or sql_text(name) with the window sizes filled in) name the views person, auction,
bid and events; a pipeline registers them under names of its own (a suffix per pipeline built), so that
two queries built in one session one after the other do not take each other's views.

Windows are scaled to seconds, as a stream of a few thousand events a second needs: Q5 counts bids in
10 s windows sliding every 2 s, Q7 and Q8 use 10 s tumbling windows (make_pipeline changes them).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from pyspark.sql import DataFrame
from pyspark.sql.streaming.readwriter import DataStreamWriter

from ingest.spark.pipeline import PipelineContext

EVENT_SCHEMA = (
    "event_type INT, "
    "person STRUCT<id: BIGINT, name: STRING, emailAddress: STRING, creditCard: STRING, city: STRING, "
    "state: STRING, dateTime: TIMESTAMP, extra: STRING>, "
    "auction STRUCT<id: BIGINT, itemName: STRING, description: STRING, initialBid: BIGINT, reserve: BIGINT, "
    "dateTime: TIMESTAMP, expires: TIMESTAMP, seller: BIGINT, category: BIGINT, extra: STRING>, "
    "bid STRUCT<auction: BIGINT, bidder: BIGINT, price: BIGINT, channel: STRING, url: STRING, "
    "dateTime: TIMESTAMP, extra: STRING>"
)
"""The events table: Flink nexmark's single table. Times are ISO-8601 UTC text ("...T05:33:28.123Z"),
which from_json's default timestamp format reads, whatever the session's time zone."""

# The views, as SQL over the source (Kafka's columns: key, value, topic, partition, offset, timestamp,
# timestampType); every view keeps the record's stream offset as source_offset. The watermark is set
# once, on the events view's dateTime, in DataFrame code (Spark SQL has no clause for it; Spark refuses a
# second one on the way to a stateful operator): person, auction and bid take their dateTime from there.
VIEWS_SQL = {
    "events": (
        "SELECT e.event_type, e.person, e.auction, e.bid, "
        "coalesce(e.person.dateTime, e.auction.dateTime, e.bid.dateTime) AS dateTime, "
        "offset AS source_offset "
        "FROM (SELECT from_json(CAST(value AS STRING), '{schema}') AS e, offset FROM {source})"
    ),
    "person": (
        "SELECT person.id, person.name, person.emailAddress, person.creditCard, person.city, "
        "person.state, dateTime, person.extra, source_offset FROM {events} WHERE event_type = 0"
    ),
    "auction": (
        "SELECT auction.id, auction.itemName, auction.description, auction.initialBid, auction.reserve, "
        "dateTime, auction.expires, auction.seller, auction.category, auction.extra, source_offset "
        "FROM {events} WHERE event_type = 1"
    ),
    "bid": (
        "SELECT bid.auction, bid.bidder, bid.price, bid.channel, bid.url, dateTime, bid.extra, "
        "source_offset FROM {events} WHERE event_type = 2"
    ),
}

SQL = {
    # Q0, pass-through: every event, parsed (the cost of reading and parsing, the baseline)
    "q0": "SELECT source_offset, event_type, dateTime, person, auction, bid FROM {events}",
    # Q1, currency conversion: bid prices from dollars to euros (an exact decimal)
    "q1": (
        "SELECT auction, bidder, 0.908 * price AS price, channel, url, dateTime, extra, source_offset "
        "FROM {bid}"
    ),
    # Q2, selection: the bids on auctions whose id is a multiple of 123 (Beam's and Flink's Q2)
    "q2": "SELECT auction, price, source_offset FROM {bid} WHERE auction % 123 = 0",
    # Q5, hot items: per sliding window, the auction(s) with the most bids (all of them on a tie)
    "q5": (
        "WITH counts AS ("
        " SELECT window(dateTime, '{window}', '{slide}') AS w, auction, count(*) AS num"
        " FROM {bid} GROUP BY window(dateTime, '{window}', '{slide}'), auction"
        "), tops AS ("
        " SELECT w, max(num) AS max_num, collect_list(struct(auction, num)) AS counted"
        " FROM counts GROUP BY w"
        ") "
        "SELECT w.start AS window_start, w.end AS window_end, hot.auction, hot.num "
        "FROM tops LATERAL VIEW explode(filter(counted, c -> c.num = max_num)) AS hot"
    ),
    # Q7, highest bid: per tumbling window, the bid with the highest price (ties: the greatest
    # (price, auction, bidder, dateTime, source_offset))
    "q7": (
        "SELECT w.start AS window_start, w.end AS window_end, top.price, top.auction, top.bidder, "
        "top.dateTime, top.source_offset "
        "FROM (SELECT window(dateTime, '{tumble}') AS w, "
        "max(struct(price, auction, bidder, dateTime, source_offset)) AS top "
        "FROM {bid} GROUP BY window(dateTime, '{tumble}'))"
    ),
    # Q8, new users: people who opened an auction in the tumbling window they registered in (a
    # stream-stream join on the window, state bounded by the watermarks)
    "q8": (
        "SELECT P.id, P.name, P.w.start AS window_start, P.w.end AS window_end "
        "FROM (SELECT id, name, window(dateTime, '{tumble}') AS w FROM {person}) P "
        "JOIN (SELECT seller, window(dateTime, '{tumble}') AS w FROM {auction} "
        "      GROUP BY seller, window(dateTime, '{tumble}')) A "
        "ON P.id = A.seller AND P.w = A.w"
    ),
}


@dataclass(frozen=True)
class Windows:
    """Window sizes of the windowed queries, and the watermark's delay (Spark interval text)."""

    window: str = "10 seconds"
    """Q5's sliding window length."""
    slide: str = "2 seconds"
    """Q5's slide."""
    tumble: str = "10 seconds"
    """Q7's and Q8's tumbling window."""
    watermark: str = "2 seconds"
    """How late (in event time) an event may come and still count: one producer's events arrive in
    order, so a little is plenty; several producers at once may need more."""


def sql_text(name: str, windows: Windows | None = None, views: dict[str, str] | None = None) -> str:
    """The SQL of query `name` over views named person, auction, bid, events (or `views`' names)."""
    w = windows or Windows()
    names = {view: view for view in VIEWS_SQL} | (views or {})
    return SQL[name].format(window=w.window, slide=w.slide, tumble=w.tumble, **names)


_views_made = itertools.count()


def register_views(df: DataFrame, suffix: str, watermark: str = Windows.watermark) -> dict[str, str]:
    """Temporary views events, person, auction, bid over the source DataFrame `df`, their names ending
    in `suffix`; returns {view: registered name}."""
    spark = df.sparkSession
    names = {view: f"nexmark_{view}_{suffix}" for view in ("source", *VIEWS_SQL)}
    df.createOrReplaceTempView(names["source"])
    for view, sql in VIEWS_SQL.items():
        parsed = spark.sql(sql.format(schema=EVENT_SCHEMA, **names))
        if view == "events":
            parsed = parsed.withWatermark("dateTime", watermark)
        parsed.createOrReplaceTempView(names[view])
    return names


NexmarkPipeline = Callable[[DataFrame, PipelineContext], DataStreamWriter]


def make_pipeline(name: str, windows: Windows | None = None) -> NexmarkPipeline:
    """The Sluice pipeline of query `name` (q0, q1, q2, q5, q7, q8): Parquet appended to the
    context's sink folder."""
    if name not in SQL:
        raise ValueError(f"no Nexmark query {name!r}; there are {', '.join(SQL)}")
    w = windows or Windows()

    def pipeline(df: DataFrame, context: PipelineContext) -> DataStreamWriter:
        names = register_views(df, f"g{context.generation}_{next(_views_made)}", w.watermark)
        result = df.sparkSession.sql(sql_text(name, w, names))
        return result.writeStream.format("parquet").outputMode("append").option("path", str(context.sink_dir))

    pipeline.__name__ = pipeline.__qualname__ = name
    pipeline.__doc__ = f"Nexmark {name.upper()} to Parquet under context.sink_dir:\n\n{sql_text(name, w)}"
    return pipeline


q0 = make_pipeline("q0")
q1 = make_pipeline("q1")
q2 = make_pipeline("q2")
q5 = make_pipeline("q5")
q7 = make_pipeline("q7")
q8 = make_pipeline("q8")

QUERIES: dict[str, NexmarkPipeline] = {"q0": q0, "q1": q1, "q2": q2, "q5": q5, "q7": q7, "q8": q8}
"""The pipelines by name, as `--pipeline ingest.nexmark.queries:NAME` loads them."""
