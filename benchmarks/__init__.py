"""Benchmark harness: Snapline against a plain confluent-kafka loop and Quix Streams.

Run ``python -m benchmarks run --quick`` for a smoke test, ``python -m benchmarks run`` for the
published numbers and ``python -m benchmarks recovery`` for recovery times.
"""
