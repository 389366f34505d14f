"""What streams nobody publishes to cost a server: its CPU while idle, and how long an AddStream and a
ListStreams take, with many streams against one stream, measured in the same run.

Run: python bench/idle_streams.py [--streams 1000] [--seconds 5]

The server runs here, without Spark (as `sluice serve --no-spark`), the block log under a temp dir; the
CPU is this process's (the server's event loop and its threads) over `--seconds` after the start has
settled. An admin call's time is the median of 20 calls.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from ingest.config import RateConfig, ServeConfig
from ingest.server import SluiceServer
from receivers.config import ReceiverConfig
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc


async def measure(streams: int, seconds: float) -> tuple[float, float, float]:
    """(cores used while idle, AddStream seconds, ListStreams seconds) with `streams` streams."""
    with tempfile.TemporaryDirectory() as folder:
        config = ServeConfig(
            port=0,
            metrics_port=0,
            data_dir=Path(folder),
            streams=tuple(f"s{i}" for i in range(streams)),
            receiver=ReceiverConfig(),
            rate=RateConfig(estimator="fixed", initial_rate=math.inf),
            spark=False,
        )
        server = SluiceServer(config)
        await server.start()
        try:
            await asyncio.sleep(2)  # the start's first ticks and samples
            cpu, wall = time.process_time(), time.monotonic()
            await asyncio.sleep(seconds)
            cores = (time.process_time() - cpu) / (time.monotonic() - wall)
            async with grpc.aio.insecure_channel(server.target) as channel:
                admin = pb_grpc.AdminStub(channel)
                adds, lists = [], []
                for i in range(20):
                    started = time.perf_counter()
                    await admin.AddStream(pb.AddStreamRequest(stream=f"added{i}"))
                    adds.append(time.perf_counter() - started)
                    started = time.perf_counter()
                    await admin.ListStreams(pb.ListStreamsRequest())
                    lists.append(time.perf_counter() - started)
            return cores, statistics.median(adds), statistics.median(lists)
        finally:
            await server.stop(grace=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    one = asyncio.run(measure(1, args.seconds))
    many = asyncio.run(measure(args.streams, args.seconds))
    print(f"{'':24}{'1 stream':>12}{f'{args.streams} streams':>16}{'ratio':>9}")
    for i, (what, scale) in enumerate(
        (("idle CPU (cores)", 1.0), ("AddStream (ms)", 1e3), ("ListStreams (ms)", 1e3))
    ):
        ratio = many[i] / one[i] if one[i] > 0 else math.inf
        print(f"{what:24}{one[i] * scale:>12.3f}{many[i] * scale:>16.3f}{ratio:>8.1f}x")


if __name__ == "__main__":
    main()
