"""Blocks: the unit a receiver seals every block interval, stores durably and hands to Spark.

A block holds the records one receiver took for one stream during one block interval, as Arrow record
batches with BLOCK_SCHEMA. Records get consecutive stream offsets (like Kafka offsets); a block knows the
offset of its first record, so offsets need not be stored per record.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

BLOCK_SCHEMA = pa.schema(
    [
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary(), nullable=False),
        pa.field("timestamp", pa.timestamp("us", tz="UTC"), nullable=False),
    ]
)


@dataclass(frozen=True, order=True)
class BlockInfo:
    """Where a sealed block sits in its stream. Ordered by (stream, seq)."""

    stream: str
    seq: int
    """Position of the block in its stream: 0, 1, 2, ... with no gaps."""
    first_offset: int
    """Stream offset of the block's first record."""
    count: int
    """Number of records in the block."""
    receiver: int
    """Id of the receiver that sealed the block (the analogue of a Kafka partition)."""

    @property
    def end_offset(self) -> int:
        """Stream offset one past the block's last record."""
        return self.first_offset + self.count
