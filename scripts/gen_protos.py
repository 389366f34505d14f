"""Generate the Python code and mypy stubs for proto/ into sluice_client/pb/.

Usage: python scripts/gen_protos.py [--check]

--check regenerates into a temporary folder and fails (exit 1) when the committed code differs.
The generated code lives in the client SDK (sluice_client), which needs it and nothing of the server's;
the server's packages import it from there (as Kafka's broker takes its protocol from kafka-clients).
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "sluice_client" / "pb"
PACKAGE = "sluice_client.pb"


def generate(out: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    out.mkdir(parents=True, exist_ok=True)
    bindir = Path(sys.executable).parent  # mypy-protobuf's plugins sit beside the interpreter
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
            f"--mypy_out={out}",
            f"--mypy_grpc_out={out}",
            *protos,
        ],
        check=True,
    )
    # protoc writes absolute imports rooted at the proto path; root them at our package instead.
    for path in out.rglob("*.py*"):
        text = path.read_text()
        fixed = text.replace("from ingest.v1 import", f"from {PACKAGE}.ingest.v1 import")
        fixed = fixed.replace("import ingest.v1.", f"import {PACKAGE}.ingest.v1.")
        path.write_text(fixed)
    for folder in [out, *(p for p in out.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()


def differences(a: Path, b: Path) -> list[str]:
    names = {p.relative_to(a) for p in a.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    names |= {p.relative_to(b) for p in b.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    return sorted(
        str(n)
        for n in names
        if not ((a / n).exists() and (b / n).exists() and filecmp.cmp(a / n, b / n, shallow=False))
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when regenerating changes anything")
    args = parser.parse_args()
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            diff = differences(Path(tmp), OUT_DIR)
        if diff:
            print("generated protobuf code is stale; run scripts/gen_protos.py:", *diff, sep="\n  ")
            return 1
        print("generated protobuf code is up to date")
        return 0
    shutil.rmtree(OUT_DIR, ignore_errors=True)
    generate(OUT_DIR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
