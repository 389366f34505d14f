"""Compatibility alias: the client SDK is the `sluice_client` package (it needs neither the server's
code nor Spark). `ingest.client`, `ingest.client.producer`, `.sync`, `.credentials`, `.metrics` and
`.flow` (now `sluice_client.publish`) keep working for code written against them."""

import sys

from sluice_client import Credentials, Producer, SyncProducer, credentials, metrics, producer, publish, sync

for _name, _module in {
    "producer": producer,
    "sync": sync,
    "credentials": credentials,
    "metrics": metrics,
    "flow": publish,
}.items():
    sys.modules[f"{__name__}.{_name}"] = _module
    globals()[_name] = _module

__all__ = ["Credentials", "Producer", "SyncProducer"]
