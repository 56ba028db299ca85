"""Snapline: exactly-once stream pipelines on Apache Kafka."""
