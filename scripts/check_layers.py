"""Fail when an import crosses the architecture's layers.

ingest -> receivers -> sluice_client, and ratecontrol: ratecontrol imports none of the others (nor gRPC,
Spark, I/O libraries), receivers never imports ingest or pyspark, and the client SDK (sluice_client)
imports none of the server's packages, Spark, pyarrow or pandas.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "ratecontrol": {"ingest", "receivers", "grpc", "pyspark", "pyarrow", "prometheus_client", "asyncio"},
    "receivers": {"ingest", "pyspark"},
    # the client SDK: neither the server's code nor Spark (nor the server's heavy libraries)
    "sluice_client": {"ingest", "receivers", "ratecontrol", "pyspark", "pyarrow", "pandas"},
}


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def main() -> int:
    problems = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in sorted(imported(path) & forbidden):
                problems.append(f"{path.relative_to(ROOT)} imports {name}: {package} must not")
    print("\n".join(problems) or "layers are clean")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
