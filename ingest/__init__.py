"""Sluice ingestion: the Spark side and the service entry points."""

import os

# gRPC's C core logs each failed TLS handshake (a port scan, a plaintext client) at INFO on stderr in
# its own format, a line per connection, past --log-format json. It reads GRPC_VERBOSITY once, when grpc
# is imported: hence here, before any module of ours imports it. Its errors still show; a user's own
# GRPC_VERBOSITY or GRPC_TRACE (which logs at INFO) wins.
if "GRPC_VERBOSITY" not in os.environ and "GRPC_TRACE" not in os.environ:
    os.environ["GRPC_VERBOSITY"] = "ERROR"
