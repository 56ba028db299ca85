"""Sinks: the two-phase-commit contract, Kafka, Parquet and PostgreSQL."""
