"""Sluice ingestion: the Spark side and the service entry points."""
