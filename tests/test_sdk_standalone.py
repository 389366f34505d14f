"""The client SDK (sluice_client) needs neither the server's code nor Spark.

A subprocess refuses every import of ingest, receivers, ratecontrol, pyspark, pyarrow and pandas, then
pushes records to a real server with Producer, SyncProducer and the Reactive Streams bridge (publish +
from_observable), with keys and without: all are acked and in the server's block log. And the SDK's
numpy encoding of keys is byte for byte Arrow's layout (what the receiver wraps as Arrow buffers).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa

from sluice_client.wire import encode_batch
from tests.support import running_server

ROOT = Path(__file__).resolve().parent.parent

CLIENT = textwrap.dedent(
    """
    import asyncio, importlib.abc, sys

    FORBIDDEN = {"ingest", "receivers", "ratecontrol", "pyspark", "pyarrow", "pandas"}

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in FORBIDDEN:
                raise ImportError(f"the SDK imported {name}")
            return None

    sys.meta_path.insert(0, Refuse())

    import reactivex
    from sluice_client import Producer, SyncProducer
    from sluice_client.publish import from_observable, publish

    target = sys.argv[1]

    async def main():
        async with Producer(target, "s", producer_id="async") as producer:
            keys = [b"k" if i % 3 else None for i in range(100)]
            await producer.send_many([b"a%d" % i for i in range(100)], keys)
            await producer.flush(30)
            assert producer.acked == 100, producer.acked
        async with Producer(target, "s", producer_id="rx") as producer:
            records = reactivex.from_iterable([b"r%d" % i for i in range(50)])
            count = await publish(producer, from_observable(records, capacity=10))
            assert count == 50, count

    asyncio.run(main())
    with SyncProducer(target, "s", producer_id="sync") as producer:
        producer.send_many([b"s%d" % i for i in range(25)])
        producer.flush(30)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)
    assert not loaded, loaded
    print("sent")
    """
)


async def test_the_sdk_pushes_without_the_server_code_or_spark(tmp_path: Path) -> None:
    async with running_server(tmp_path / "data", "s") as server:
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", CLIENT, server.target],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip() == "sent"
        values = []
        for block in server.store.blocks("s"):
            for batch in server.store.read(block):
                values.extend(batch.column("value").to_pylist())
    expected = [b"a%d" % i for i in range(100)] + [b"r%d" % i for i in range(50)]
    expected += [b"s%d" % i for i in range(25)]
    assert sorted(values) == sorted(expected)


def test_keys_are_encoded_in_arrows_binary_layout() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 40)
        keys = [None if rng.random() < 0.3 else rng.randbytes(rng.randint(0, 5)) for _ in range(n)]
        values = [rng.randbytes(rng.randint(0, 5)) for _ in range(n)]
        batch = encode_batch(0, values, keys)
        array = pa.array(keys, type=pa.binary())
        validity, offsets, data = array.buffers()
        if all(k is None for k in keys):
            assert not batch.key_offsets  # no key at all: none sent
            continue
        assert batch.key_offsets == offsets.to_pybytes()[: 4 * (n + 1)]
        assert batch.keys == (data.to_pybytes() if data is not None else b"")[: len(batch.keys)]
        assert len(batch.keys) == sum(len(k) for k in keys if k is not None)
        if array.null_count:
            # Arrow leaves the bits past n unspecified; compare the ones that mean something
            got = int.from_bytes(batch.key_validity, "little")
            want = int.from_bytes(validity.to_pybytes()[: (n + 7) // 8], "little")
            mask = (1 << n) - 1
            assert got & mask == want & mask
        value_array = pa.array(values, type=pa.binary())
        assert batch.value_offsets == value_array.buffers()[1].to_pybytes()[: 4 * (n + 1)]


def test_the_sdk_builds_as_its_own_wheel_without_the_server(tmp_path: Path) -> None:
    import zipfile

    # a copy: the build writes build/ and egg-info next to the project file
    source = tmp_path / "sluice_client"
    shutil.copytree(ROOT / "sluice_client", source, ignore=shutil.ignore_patterns("__pycache__"))
    wheel_dir = tmp_path / "w"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    built = subprocess.run(
        [*pip_wheel, "-w", str(wheel_dir), str(source)],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheel_dir.glob("sluice_client-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith("METADATA"))).decode()
    packages = {n.split("/")[0] for n in names if not n.startswith("sluice_client-")}
    assert packages == {"sluice_client"}
    assert "sluice_client/pb/ingest/v1/ingest_pb2.py" in names
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert requires and not any(x in line for line in requires for x in ("pyspark", "pyarrow", "pandas"))
