"""librdkafka settings: passthrough from the user, and redaction so secrets never reach logs
(``redact`` for a config dict; ``redact_text`` and ``RedactingFilter`` for any text: URIs with
credentials, DSN passwords)."""

from __future__ import annotations

import logging
import re
import sys
import threading
import traceback
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


#: ``scheme://user:password@``: the whole user part goes (an access key id is half a secret),
#: up to the token's last ``@``: a secret pasted unencoded may hold ``/`` (half of AWS secret
#: keys do) or ``@``. A path with an ``@`` loses its start too: more redacted, never less.
#: A URI and the rest of its token in one match, cut in ``_userinfo`` (linear in the text).
_URI_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^\s'\"]*)")


def _userinfo(match: re.Match[str]) -> str:
    rest = match.group(2)
    at = rest.rfind("@")
    return match.group(0) if at < 0 else f"{match.group(1)}***{rest[at:]}"


#: A query parameter or ``key=value`` setting whose name says secret.
_SECRET_SETTING = re.compile(
    r"(?i)\b([\w.-]*(?:password|passwd|secret|token|passphrase|credential|access_key|"
    r"secret_key|api_key)[\w.-]*\s*=\s*)('[^']*'|\"[^\"]*\"|[^\s&'\",;)]+)"
)


#: A quoted key and its quoted value, as a dict's repr or JSON prints them
#: (``'sasl.password': 'x'``, ``"sasl.password": "x"``); redacted when the key is secret.
_QUOTED_ITEM = re.compile(
    r"""(['"])([^'"\s]{1,200})\1(\s*:\s*)('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")"""
)


def _quoted_item(match: re.Match[str]) -> str:
    if not is_secret(match.group(2)):
        return match.group(0)
    quote = match.group(4)[0]
    return f"{match.group(1)}{match.group(2)}{match.group(1)}{match.group(3)}{quote}***{quote}"


def redact_text(text: str) -> str:
    """``text`` with credentials in URIs (``s3://key:secret@bucket``, ``postgresql://u:p@h``),
    secret-named settings (``password=...``, ``?secret_key=...``) and the values of
    secret-named keys of a printed dict or JSON (``'sasl.password': '...'``) replaced by
    ``***``."""
    if "=" not in text and "@" not in text and ":" not in text:
        return text
    text = _SECRET_SETTING.sub(r"\1***", _URI_USERINFO.sub(_userinfo, text))
    if "'" in text or '"' in text:
        text = _QUOTED_ITEM.sub(_quoted_item, text)
    return text


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


def _print_redacted(kind: Any, value: Any, tb: Any) -> None:
    sys.stderr.write(redact_text("".join(traceback.format_exception(kind, value, tb))))


def _print_redacted_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    sys.stderr.write(f"Exception in thread {name}:\n")
    _print_redacted(args.exc_type, args.exc_value, args.exc_traceback)


def install_redaction() -> None:
    """Put ``RedactingFilter`` on every handler of the root logger (after basicConfig), and
    redact the tracebacks of exceptions nobody caught (the process's and its threads')."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _print_redacted
    if threading.excepthook is threading.__excepthook__:
        threading.excepthook = _print_redacted_thread
