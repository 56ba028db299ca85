"""librdkafka settings: passthrough from the user, and redaction so secrets never reach logs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_SECRET_MARKERS = (
    "password",
    "secret",
    "jaas",
    "key.pem",
    "keystore",
    "token",
    "ssl.key",
    "oauthbearer.config",
    "api.key",
)


def is_secret(name: str) -> bool:
    lowered = name.lower()
    return any(marker in lowered for marker in _SECRET_MARKERS)


def redact(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` safe to log: secret values replaced by ``***``."""
    return {k: ("***" if is_secret(k) else v) for k, v in config.items()}
