"""Value and key formats on the wire: how Kafka bytes become values and back.

One place for the codecs that sources, sinks and the runtime (key_by's key bytes) share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from snapline.pipeline.errors import ConfigurationError

FORMATS = ("json", "string", "bytes")


def bytes_decoder(fmt: str) -> Callable[[bytes], Any]:
    """The function turning raw Kafka bytes (not None) into a value for ``fmt``: a C function
    where there is one (the sources' per-message loop calls it without a Python frame)."""
    if fmt == "json":
        return orjson.loads
    if fmt == "string":
        return bytes.decode
    if fmt == "bytes":
        return _same
    raise ConfigurationError(f"unknown format {fmt!r}; use one of {list(FORMATS)}")


def decoder(fmt: str) -> Callable[[bytes | None], Any]:
    """``bytes_decoder`` that also takes None (a tombstone's value, a message without key)."""
    decode = bytes_decoder(fmt)
    return lambda raw: None if raw is None else decode(raw)


def value_encoder(fmt: str) -> Callable[[Any], bytes]:
    """The function turning a value (not None) into Kafka bytes for ``fmt``: a C function
    where there is one."""
    if fmt == "json":
        return orjson.dumps
    if fmt == "string":
        return lambda v: str(v).encode()
    if fmt == "bytes":
        return _as_bytes
    raise ConfigurationError(f"unknown Kafka value format {fmt!r}; use one of {list(FORMATS)}")


def _as_bytes(value: Any) -> bytes:
    """A ``bytes`` format's value: bytes as they are, a str as UTF-8 (as the producer takes
    it). Anything else raises (the record is a dead letter) here, where it used to reach the
    producer, whose TypeError (or the held records' copy of a str) ended the worker on every
    restart."""
    if type(value) is bytes:
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(
        f"value_format='bytes' takes bytes or str, not {type(value).__name__} (use 'json', "
        "or encode the value before the sink)"
    )


def encoder(fmt: str) -> Callable[[Any], bytes | None]:
    """``value_encoder`` that also takes None (a tombstone)."""
    encode = value_encoder(fmt)
    return lambda v: None if v is None else encode(v)


def _same(raw: Any) -> Any:
    return raw


def encode_key(key: Any) -> bytes | None:
    """Kafka message keys: str as UTF-8, bytes as is, anything else as JSON."""
    if key is None:
        return None
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, bytes):
        return key
    return orjson.dumps(key)


# The first byte of a tagged key says how the key bytes decode (repartition records, timers).
_KEY_STR, _KEY_BYTES, _KEY_JSON = b"s", b"b", b"j"


def tag_key(key: Any, key_bytes: bytes) -> bytes:
    """``key_bytes`` prefixed with a tag that lets ``untag_key`` rebuild ``key`` itself."""
    tag = _KEY_STR if isinstance(key, str) else _KEY_BYTES if isinstance(key, bytes) else _KEY_JSON
    return tag + key_bytes


def untag_key(raw_key: bytes) -> tuple[Any, bytes]:
    """The key and its key bytes from ``tag_key``'s output; ValueError if not tagged."""
    tag, key_bytes = raw_key[:1], raw_key[1:]
    if tag == _KEY_STR:
        return key_bytes.decode(), key_bytes
    if tag == _KEY_BYTES:
        return key_bytes, key_bytes
    if tag == _KEY_JSON:
        return orjson.loads(key_bytes), key_bytes
    raise ValueError(f"not a Snapline tagged key: {raw_key[:40]!r}")
