"""Sluice client SDK: producers that publish records to a Sluice server over gRPC."""

from sluice_client.credentials import Credentials
from sluice_client.producer import Producer
from sluice_client.sync import SyncProducer

__all__ = ["Credentials", "Producer", "SyncProducer"]
