"""Ingest throughput: one Producer into acked, durable blocks vs. a bare gRPC stream of the same batches.

Run: python bench/ingest_throughput.py [--records 2000000] [--record-bytes 100] [--batch 4096]

Both servers run in a subprocess of their own (one core each side on a 2-core machine); the client runs
here. The baseline is measured in the same run, so the ratio holds on a noisy machine where absolute
numbers drift. Prints records/s for: raw gRPC (server only counts), Sluice with fsync per block (the
default), Sluice without fsync, and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from ingest.client import Producer
from ingest.config import ServeConfig
from ingest.server import SluiceServer
from receivers.pb.ingest.v1 import ingest_pb2 as pb
from receivers.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from receivers.receiver import ReceiverConfig
from receivers.wire import encode_batch

MAX_MSG = 64 * 1024 * 1024


class RawIngest(pb_grpc.IngestServicer):
    """Counts records and acks each batch: the cheapest server that speaks the same messages."""

    async def Publish(self, request_iterator: AsyncIterator[pb.PublishRequest], context: object):  # type: ignore[override]
        seq = 0
        async for request in request_iterator:
            if request.HasField("batch"):
                seq += request.batch.count
                yield pb.PublishResponse(ack=pb.Ack(durable_up_to=seq))


def serve(
    kind: str, port_queue: mp.Queue, data_dir: str, fsync: bool, buffer: int, block_interval: float
) -> None:  # type: ignore[type-arg]
    async def main() -> None:
        if kind == "raw":
            server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MSG)])
            pb_grpc.add_IngestServicer_to_server(RawIngest(), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            port_queue.put(port)
            await server.wait_for_termination()
        else:
            config = ServeConfig(
                port=0,
                metrics_port=None,
                data_dir=Path(data_dir),
                streams=("bench",),
                fsync=fsync,
                spark=False,
                max_message_bytes=MAX_MSG,
                receiver=ReceiverConfig(
                    buffer_records=buffer, prefetch=buffer // 2, block_interval=block_interval
                ),
            )
            sluice = SluiceServer(config)
            await sluice.start()
            port_queue.put(sluice.port)
            await sluice.wait_stopped()

    asyncio.run(main())


async def push_raw(target: str, records: int, batch: pb.Batch) -> float:
    async with grpc.aio.insecure_channel(
        target, options=[("grpc.max_send_message_length", MAX_MSG)]
    ) as channel:
        call = pb_grpc.IngestStub(channel).Publish()
        await call.write(pb.PublishRequest(open=pb.Open(stream="bench")))
        started = time.perf_counter()
        sent = 0

        async def reader() -> None:
            async for response in call:
                if response.ack.durable_up_to >= records:
                    return

        task = asyncio.create_task(reader())
        request = pb.PublishRequest(batch=batch)
        while sent < records:
            await call.write(request)
            sent += batch.count
        await task
        elapsed = time.perf_counter() - started
        await call.done_writing()
        return elapsed


async def push_sluice(target: str, records: int, values: list[bytes], batch: int) -> float:
    async with Producer(target, "bench", batch_size=batch, batch_bytes=MAX_MSG // 2) as producer:
        started = time.perf_counter()
        sent = 0
        while sent < records:
            await producer.send_many(values)
            sent += len(values)
        await producer.flush(timeout=300)
        return time.perf_counter() - started


def run(kind: str, args: argparse.Namespace, fsync: bool = True) -> float:
    ctx = mp.get_context("spawn")
    ports: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory() as data_dir:
        proc = ctx.Process(
            target=serve, args=(kind, ports, data_dir, fsync, args.buffer, args.block_interval), daemon=True
        )
        proc.start()
        try:
            target = f"127.0.0.1:{ports.get(timeout=60)}"
            values = [os.urandom(args.record_bytes // 2).hex().encode()[: args.record_bytes]] * args.batch
            if kind == "raw":
                elapsed = asyncio.run(push_raw(target, args.records, encode_batch(0, values)))
            else:
                elapsed = asyncio.run(push_sluice(target, args.records, values, args.batch))
        finally:
            proc.terminate()
            proc.join(10)
    return args.records / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2_000_000)
    parser.add_argument("--record-bytes", type=int, default=100)
    parser.add_argument("--batch", type=int, default=4096, help="records per Batch message")
    parser.add_argument(
        "--buffer",
        type=int,
        default=ReceiverConfig().buffer_records,
        help="receiver buffer_records (default: the server's default)",
    )
    parser.add_argument("--block-interval", type=float, default=ReceiverConfig().block_interval)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each; the best counts")
    args = parser.parse_args()
    results: dict[str, float] = {}
    for name, kind, fsync in [
        ("raw gRPC", "raw", True),
        ("sluice (fsync)", "sluice", True),
        ("sluice (no fsync)", "sluice", False),
    ]:
        results[name] = max(run(kind, args, fsync) for _ in range(args.repeat))
    raw = results["raw gRPC"]
    head = f"{args.records:,} records of {args.record_bytes} B, {args.batch} records/batch"
    print(f"{head}, best of {args.repeat}")
    for name, rate in results.items():
        print(f"  {name:<18} {rate:>12,.0f} rec/s   {rate / raw:6.1%} of raw")


if __name__ == "__main__":
    main()
