"""librdkafka settings: passthrough from the user, and redaction so secrets never reach logs
(``redact`` for a config dict; ``redact_text`` and ``RedactingFilter`` for any text: URIs with
credentials, DSN passwords)."""

from __future__ import annotations

import logging
import re
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
    "passphrase",
    "private.key",
    "credential",
)


def is_secret(name: str) -> bool:
    lowered = name.lower()
    return any(marker in lowered for marker in _SECRET_MARKERS)


def redact(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` safe to log: secret values replaced by ``***``."""
    return {k: ("***" if is_secret(k) else v) for k, v in config.items()}


#: ``scheme://user:password@``: the whole user part goes (an access key id is half a secret).
_URI_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s'\"]+@")
#: A query parameter or ``key=value`` setting whose name says secret.
_SECRET_SETTING = re.compile(
    r"(?i)\b([\w.-]*(?:password|passwd|secret|token|passphrase|credential|access_key|"
    r"secret_key|api_key)[\w.-]*\s*=\s*)('[^']*'|\"[^\"]*\"|[^\s&'\",;)]+)"
)


def redact_text(text: str) -> str:
    """``text`` with credentials in URIs (``s3://key:secret@bucket``, ``postgresql://u:p@h``)
    and secret-named settings (``password=...``, ``?secret_key=...``) replaced by ``***``."""
    if "=" not in text and "@" not in text:
        return text
    return _SECRET_SETTING.sub(r"\1***", _URI_USERINFO.sub(r"\1***@", text))


class RedactingFilter(logging.Filter):
    """Redacts every record a handler emits (message, arguments, traceback): a checkpoint URI
    or DSN with credentials in an error message never reaches the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_text(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        return True


def install_redaction() -> None:
    """Put ``RedactingFilter`` on every handler of the root logger (after basicConfig)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
