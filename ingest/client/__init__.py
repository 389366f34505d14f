"""Sluice client SDK: producers that publish records to a Sluice server over gRPC."""

from ingest.client.credentials import Credentials
from ingest.client.producer import Producer
from ingest.client.sync import SyncProducer

__all__ = ["Credentials", "Producer", "SyncProducer"]
