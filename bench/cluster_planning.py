"""What one micro-batch's planning costs the driver as receiver nodes are added.

Starts N receiver nodes in this process (real gRPC servers on loopback, replication 1, no Spark), gives
each a few blocks, and times what the cluster source does on the driver for every batch: latestOffset
(every node's ListPartitions with a seal, then water-filling over the partitions) and partitions()
(ListPartitions again, ranges cut into tasks with their holders). Ratios are against 1 node, measured in
the same run. All nodes share this machine's cores with the planner, so read the growth, not the
absolute times; on real machines each node answers in parallel on its own cores.

    python bench/cluster_planning.py --nodes 1,4,16,32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pyspark.sql.streaming.datasource import ReadAllAvailable

from ingest.spark.cluster_source import ClusterStreamReader
from sluice_client import Producer
from tests.support import loopback_cluster, running_server


class Nodes:
    """N receiver nodes served by an event loop on a background thread."""

    def __init__(self, n: int, root: Path, records: int) -> None:
        self.clusters = loopback_cluster(n)
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop = asyncio.new_event_loop()
        serving = self._serve(root, records)
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(serving,))
        self._thread.start()
        self._ready.wait()

    async def _serve(self, root: Path, records: int) -> None:
        self._stop = asyncio.Event()
        async with contextlib.AsyncExitStack() as stack:
            for cluster in self.clusters:
                port = int(cluster.me.target.rsplit(":", 1)[1])
                server = await stack.enter_async_context(
                    running_server(root / f"n{cluster.me.id}", "s", cluster=cluster, port=port)
                )
                async with Producer(server.target, "s", linger=0) as producer:
                    for _ in range(4):  # a few blocks per node
                        await producer.send_many([b"x" * 100] * (records // 4))
                        await producer.flush(30)
                        await asyncio.sleep(0.03)
            self._ready.set()
            await self._stop.wait()

    def close(self) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join()

    @property
    def receivers(self) -> str:
        return ",".join(f"{c.me.id}={c.me.target}" for c in self.clusters)


def plan_times(receivers: str, rounds: int) -> tuple[float, float]:
    """Median seconds of latestOffset and of partitions() over `rounds` batches."""
    reader = ClusterStreamReader({"receivers": receivers, "streams": "s", "minPartitions": "2"})
    start = reader.initialOffset()
    latest, parts = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        end = reader.latestOffset(start, ReadAllAvailable())
        t1 = time.perf_counter()
        reader.partitions(start, end)
        t2 = time.perf_counter()
        latest.append(t1 - t0)
        parts.append(t2 - t1)
    reader.stop()
    return statistics.median(latest), statistics.median(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1,4,16,32", help="node counts (default: %(default)s)")
    parser.add_argument("--records", type=int, default=2000, help="records per node")
    parser.add_argument("--rounds", type=int, default=15, help="batches planned per count")
    args = parser.parse_args()
    counts = [int(n) for n in args.nodes.split(",")]
    rows = []
    for n in counts:
        with tempfile.TemporaryDirectory() as tmp:
            nodes = Nodes(n, Path(tmp), args.records)
            try:
                rows.append((n, *plan_times(nodes.receivers, args.rounds)))
            finally:
                nodes.close()
    base = rows[0][1] + rows[0][2]
    print(f"{'nodes':>6} {'latestOffset ms':>16} {'partitions ms':>14} {'total ms':>9} {'vs 1st':>7}")
    for n, latest, parts in rows:
        total = latest + parts
        print(f"{n:>6} {latest * 1e3:>16.1f} {parts * 1e3:>14.1f} {total * 1e3:>9.1f} {total / base:>6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
