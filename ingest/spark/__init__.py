"""Spark side of Sluice: the "sluice" streaming data source, session set-up, pipelines and listeners."""
