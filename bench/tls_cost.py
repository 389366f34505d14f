"""What TLS costs ingest: producer throughput over TLS, mutual TLS and TLS with a bearer token, each a
ratio against plaintext measured in the same run.

Run: python bench/tls_cost.py [--records 1000000] [--record-bytes 100] [--batch 4096] [--rounds 3]

The server runs in a subprocess of its own (one core each side on a 2-core machine), the real Producer
here. The block log is appended but not fsynced (--fsync for the default policy), so the transport's
cost is not hidden behind the disk's. Variants run interleaved, round after round (plaintext, TLS, mTLS,
token, plaintext, ...), and the best round of each counts: machine noise drifts over minutes, and
interleaving spreads it over every variant alike. Certificates: a throwaway set (sluice dev-certs), ECDSA
P-256, the cipher gRPC negotiates (TLS 1.3, AES-GCM).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import tempfile
from pathlib import Path
from typing import Any

from ingest_throughput import MAX_MSG, push_producer  # this folder: run as python bench/tls_cost.py
from sluice_process import client_loop

from ingest.config import RateConfig, SecurityConfig, ServeConfig, TlsConfig
from ingest.dev_certs import write_dev_certs
from ingest.server import SluiceServer
from receivers.auth import token_hash
from receivers.config import FsyncPolicy
from sluice_client.credentials import Credentials

TOKEN = "bench-token-" + "x" * 32

VARIANTS = {
    "plain": "plaintext",
    "tls": "TLS",
    "mtls": "mutual TLS",
    "token": "TLS + token",
}


def serve(variant: str, ports: Any, data_dir: str, certs: dict[str, str], fsync: bool) -> None:
    async def main() -> None:
        tls = None
        if variant != "plain":
            tls = TlsConfig(
                Path(certs["server_cert"]),
                Path(certs["server_key"]),
                Path(certs["ca"]) if variant == "mtls" else None,
            )
        auth_file = Path(certs["auth"]) if variant == "token" else None
        config = ServeConfig(
            rate=RateConfig(estimator="fixed", initial_rate=math.inf),  # throughput: unthrottled
            port=0,
            metrics_port=None,
            data_dir=Path(data_dir),
            streams=("bench",),
            fsync=FsyncPolicy.every_block() if fsync else FsyncPolicy.off(),
            spark=False,
            max_message_bytes=MAX_MSG,
            security=SecurityConfig(tls=tls, auth_file=auth_file),
        )
        sluice = SluiceServer(config)
        await sluice.start()
        ports.put(sluice.port)
        await sluice.wait_stopped()

    asyncio.run(main())


def credentials(variant: str, certs: dict[str, str]) -> Credentials:
    if variant == "plain":
        return Credentials()
    mutual = variant == "mtls"
    return Credentials(
        root_certificates=Path(certs["ca"]).read_bytes(),
        certificate_chain=Path(certs["client_cert"]).read_bytes() if mutual else None,
        private_key=Path(certs["client_key"]).read_bytes() if mutual else None,
        token=TOKEN if variant == "token" else None,
        server_name="localhost",
    )


def run(variant: str, args: argparse.Namespace, certs: dict[str, str]) -> float:
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    with tempfile.TemporaryDirectory() as data_dir:
        proc = ctx.Process(target=serve, args=(variant, ports, data_dir, certs, args.fsync), daemon=True)
        proc.start()
        try:
            target = f"127.0.0.1:{ports.get(timeout=60)}"
            values = [b"v" * args.record_bytes] * args.batch
            elapsed = client_loop().run_until_complete(  # one loop for every run's grpc.aio client
                # send_many, as when its figures in docs/benchmarks.md were taken
                push_producer(
                    target, args.records, values, args.batch, credentials(variant, certs), packed=False
                )
            )
        finally:
            proc.terminate()
            proc.join(10)
    return args.records / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--record-bytes", type=int, default=100)
    parser.add_argument("--batch", type=int, default=4096, help="records per Batch message")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of each counts")
    parser.add_argument("--fsync", action="store_true", help="fsync every block (the default policy)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        made = write_dev_certs(Path(tmp) / "certs", clients=["bench-client"])
        client_cert, client_key = made.clients["bench-client"]
        auth = Path(tmp) / "auth.toml"
        auth.write_text(
            f'[principals.bench]\nroles = ["producer"]\nstreams = ["bench"]\n'
            f'token_sha256 = ["{token_hash(TOKEN)}"]\n'
        )
        certs = {
            "ca": str(made.ca_file),
            "server_cert": str(made.server_cert),
            "server_key": str(made.server_key),
            "client_cert": str(client_cert),
            "client_key": str(client_key),
            "auth": str(auth),
        }
        results: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for variant in VARIANTS:
                results[variant].append(run(variant, args, certs))
    best = {v: max(rates) for v, rates in results.items()}
    fsync = "fsync every block" if args.fsync else "log not fsynced"
    print(
        f"{args.records:,} records of {args.record_bytes} B, {args.batch} records/batch, {fsync}, "
        f"best of {args.rounds} interleaved rounds"
    )
    for variant, rate in best.items():
        spread = f"{min(results[variant]):,.0f}-{max(results[variant]):,.0f}"
        print(
            f"  {VARIANTS[variant]:<12} {rate:>12,.0f} rec/s   {rate / best['plain']:6.1%} of plaintext"
            f"   (rounds {spread})"
        )


if __name__ == "__main__":
    main()
