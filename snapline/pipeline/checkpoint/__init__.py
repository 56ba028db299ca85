"""Checkpoint storage and checkpoint metadata."""
