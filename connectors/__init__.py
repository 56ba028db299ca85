"""Kafka connectors: the source, admin helpers and the local broker launcher."""
