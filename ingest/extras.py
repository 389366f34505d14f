"""What the light install leaves out, and how a command says so.

`pip install sluice` gives the client SDK and the CLI's client commands (push, rate, config, streams,
pipeline, sessions, token). The server needs the `server` extra (`pip install 'sluice[server]'`): Arrow for
blocks, cryptography for TLS, gRPC's health service, and Spark (with pandas) where the query runs. A command
that needs them checks first and fails with the install line, not with a traceback from deep inside.
"""

from __future__ import annotations

import importlib.util

SERVER_INSTALL = "pip install 'sluice[server]'"
NODE_MODULES = ("pyarrow", "cryptography", "grpc_health")
"""What every server role imports: the block store (Arrow), TLS checks, the health service."""
SPARK_MODULES = ("pyspark", "pandas")
"""What a role that runs the Spark query imports besides (the single process, the cluster's driver)."""


def missing(modules: tuple[str, ...]) -> list[str]:
    """The modules of `modules` that cannot be imported here (found without importing them)."""
    absent = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a finder that refuses the name; a module without a spec
            found = False
        if not found:
            absent.append(name)
    return absent


def server_extra_problem(command: str, *, spark: bool = True) -> str | None:
    """None when `sluice COMMAND` has what it imports, else the message that says how to get it."""
    absent = missing(NODE_MODULES + (SPARK_MODULES if spark else ()))
    if not absent:
        return None
    return f"sluice {command} needs the server extra: {SERVER_INSTALL} (missing: {', '.join(absent)})"
