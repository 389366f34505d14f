"""gRPC server reflection (grpc.reflection.v1alpha): lets grpcurl-style clients list a server's services
and fetch their schemas without the .proto files. It tells only the wire contract (public anyway, in
proto/), so like health it needs no credentials."""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from sluice_client.pb.ingest.v1 import ingest_pb2 as pb

HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def service_name(name: str) -> str:
    """The full name of an ingest.v1 service: "RateControl" -> "ingest.v1.RateControl"."""
    return pb.DESCRIPTOR.services_by_name[name].full_name


def enable_reflection(server: grpc.aio.Server, services: Iterable[str]) -> None:
    """Serve reflection on `server` for the ingest.v1 `services` (short names), health and itself."""
    names = [service_name(s) for s in services]
    reflection.enable_server_reflection([*names, HEALTH, reflection.SERVICE_NAME], server)
