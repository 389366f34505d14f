"""Nexmark, the standard stream-processing benchmark, on Sluice.

ingest.nexmark.generator makes Person, Auction and Bid events and pushes them through the client SDK
(no Spark: it runs on the client side); ingest.nexmark.queries holds queries Q0-Q8 (some of them) as
Sluice pipelines written in Spark SQL. See docs/nexmark.md.
"""
