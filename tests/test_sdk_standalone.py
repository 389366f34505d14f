"""The light install (`pip install sluice`): the client SDK and the CLI's client commands without Spark.

A subprocess refuses every import of ingest, receivers, ratecontrol, pyspark, pyarrow and pandas, then
pushes records to a real server with Producer, SyncProducer and the Reactive Streams bridge (publish +
from_observable), with keys and without: all are acked and in the server's block log. And the SDK's
numpy encoding of keys is byte for byte Arrow's layout (what the receiver wraps as Arrow buffers).

The project's wheel, built from a copy of the sources, names no server library outside the `server` extra,
and the `sluice` console script it declares runs the client commands (push, rate get, streams list, token)
in a subprocess that refuses the server's libraries, while `sluice serve` and `sluice dev-certs` there
fail with the install line (exit 2).
"""

from __future__ import annotations

import asyncio
import os
import platform
import random
import re
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


SERVER_ONLY = ("pyspark", "pyarrow", "pandas", "cryptography", "grpcio-health-checking")
"""Distributions only the server needs: in the wheel's Requires-Dist under extra == "server" alone."""

# the console script's code (ingest.console:main) behind an import blocker: what a light install has
CLI = textwrap.dedent(
    """
    import importlib.abc, sys

    FORBIDDEN = {"pyspark", "pyarrow", "pandas", "cryptography", "grpc_health", "py4j"}

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in FORBIDDEN:
                raise ImportError(f"the light CLI imported {name}")
            return None

    sys.meta_path.insert(0, Refuse())

    from ingest.console import main  # what the console script runs

    code = main()
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)
    assert not loaded, loaded
    sys.exit(code)
    """
)


def _light_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CLI, *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def test_the_cli_pushes_and_refuses_to_serve_without_the_server_extra(tmp_path: Path) -> None:
    lines = [f"line {i}" for i in range(300)]
    records = tmp_path / "records.txt"
    records.write_text("".join(f"{line}\n" for line in lines))
    async with running_server(tmp_path / "data", "s") as server:
        pushed = await asyncio.to_thread(
            _light_cli, "push", str(records), "--target", server.target, "--stream", "s", "--no-progress"
        )
        assert pushed.returncode == 0, pushed.stderr[-3000:]
        rate = await asyncio.to_thread(_light_cli, "rate", "get", "--target", server.target)
        assert rate.returncode == 0, rate.stderr[-3000:]
        streams = await asyncio.to_thread(_light_cli, "streams", "list", "--target", server.target)
        assert streams.returncode == 0, streams.stderr[-3000:]
        assert "s" in streams.stdout.split()
        values = []
        for block in server.store.blocks("s"):
            for batch in server.store.read(block):
                values.extend(batch.column("value").to_pylist())
    assert sorted(values) == sorted(line.encode() for line in lines)

    token = await asyncio.to_thread(_light_cli, "token")
    assert token.returncode == 0, token.stderr[-3000:]
    assert len(token.stdout.strip()) >= 40

    for command, args in (("serve", ()), ("serve", ("--role", "receiver")), ("dev-certs", (str(tmp_path),))):
        refused = await asyncio.to_thread(
            _light_cli, command, *args, *(("--data-dir", str(tmp_path / "d")) if command == "serve" else ())
        )
        assert refused.returncode == 2, (command, args, refused.stderr[-3000:])
        first = refused.stderr.strip().splitlines()[0]
        assert first.startswith(f"sluice {command} needs the server extra: pip install 'sluice[server]'")
        assert "pyarrow" in first
        assert ("pyspark" in first) == (args == ()), first  # a receiver node runs no Spark
    assert not (tmp_path / "d").exists()  # refused before anything was made
    assert not (tmp_path / "ca.crt").exists()


def _build_wheel(tmp_path: Path) -> Path:
    # a copy of what the wheel is built from: the build writes build/ and egg-info next to pyproject.toml
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("ingest", "receivers", "ratecontrol", "sluice_client"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
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
    (wheel,) = wheel_dir.glob("sluice-*.whl")
    return wheel


def test_the_wheel_needs_no_server_library_outside_the_server_extra(tmp_path: Path) -> None:
    import zipfile
    from email.parser import Parser

    with zipfile.ZipFile(_build_wheel(tmp_path)) as archive:
        names = archive.namelist()
        metadata = Parser().parsestr(archive.read(next(n for n in names if n.endswith("/METADATA"))).decode())
        entry_points = archive.read(next(n for n in names if n.endswith("/entry_points.txt"))).decode()
    packages = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert packages == {"ingest", "receivers", "ratecontrol", "sluice_client"}
    assert "sluice_client/pb/ingest/v1/ingest_pb2.py" in names
    assert "sluice_client/py.typed" in names
    assert "sluice = ingest.console:main" in entry_points

    requires = metadata.get_all("Requires-Dist") or []
    by_extra: dict[str | None, set[str]] = {}
    for line in requires:
        requirement, _, marker = line.partition(";")
        name = re.split(r"[\s<>=!~\[(]", requirement.strip(), maxsplit=1)[0].lower()
        extra = re.search(r"extra\s*==\s*[\"']([\w-]+)[\"']", marker)
        by_extra.setdefault(extra.group(1) if extra else None, set()).add(name)
    base = by_extra[None]
    assert {"grpcio", "protobuf", "numpy", "reactivex", "prometheus-client"} <= base
    assert not base & set(SERVER_ONLY), base
    assert set(SERVER_ONLY) <= by_extra["server"]
    # CI installs .[dev] and runs everything: the server comes with it
    assert any(re.match(r"sluice\[server\].*extra\s*==\s*[\"']dev[\"']", line) for line in requires), requires
    assert set(metadata.get_all("Provides-Extra") or []) >= {"server", "dev"}


def test_tune_malloc_takes_on_glibc_and_can_be_turned_off() -> None:
    """The SDK keeps large buffers off mmap (sluice_client.allocator); SLUICE_MALLOC_TUNING=0 leaves
    malloc alone. In fresh processes: the setting is once per process."""
    code = "from sluice_client.allocator import tune_malloc; print(tune_malloc(), tune_malloc())"
    tuned = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    glibc = platform.libc_ver()[0] == "glibc"
    assert tuned.stdout.split() == ([str(glibc)] * 2)
    env = {**os.environ, "SLUICE_MALLOC_TUNING": "0"}
    left = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert left.stdout.split() == ["False", "False"]
