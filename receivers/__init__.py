"""The receiving side: Flow protocol over gRPC, receivers, blocks and the block store. Never imports Spark."""
