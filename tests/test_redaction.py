"""Secrets never reach logs, events or error messages: credentials in checkpoint URIs and
PostgreSQL DSNs, and secret-named Kafka settings."""

from __future__ import annotations

import io
import logging

import pytest

from snapline.connectors.config import RedactingFilter, redact, redact_text
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import CheckpointError
from snapline.sinks import PostgresSink
from snapline.sinks.postgres import _without_secrets


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("checkpoints s3://AKIAFAKE:FAKESECRET@bucket/jobs", "checkpoints s3://***@bucket/jobs"),
        ('in URI: "postgresql://app:FAKEPW@[db/shop"', 'in URI: "postgresql://***@[db/shop"'),
        ("host=db password=FAKEPW user=app", "host=db password=*** user=app"),
        ("host=db password='FAKE PW' user=app", "host=db password=*** user=app"),
        (
            "s3://b/p?region=eu&secret_key=FAKE&access_key=AK",
            "s3://b/p?region=eu&secret_key=***&access_key=***",
        ),
        (
            "gs://bucket/path and a=b and me@example.org",
            "gs://bucket/path and a=b and me@example.org",
        ),
    ],
)
def test_credentials_in_text_are_redacted(text: str, expected: str) -> None:
    assert redact_text(text) == expected


def test_secret_kafka_settings_are_redacted() -> None:
    config = {
        "bootstrap.servers": "b:9092",
        "sasl.password": "FAKE1",
        "sasl.oauthbearer.assertion.private.key.passphrase": "FAKE2",
        "sasl.oauthbearer.client.secret": "FAKE3",
    }
    assert "FAKE" not in str(redact(config)) and "b:9092" in str(redact(config))


def test_log_records_and_their_tracebacks_are_redacted() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactingFilter())
    logger = logging.getLogger("snapline.test.redaction")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("checkpoints %s", "s3://AKIAFAKE:FAKESECRET@bucket/jobs")
        try:
            raise CheckpointError("could not write to s3://AKIAFAKE:FAKESECRET@bucket/jobs")
        except CheckpointError:
            logger.exception("checkpoint failed")
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    assert "FAKESECRET" not in out and "AKIAFAKE" not in out
    assert out.count("s3://***@bucket/jobs") >= 2  # the message and the exception


def test_storage_errors_do_not_quote_credentials() -> None:
    with pytest.raises(CheckpointError) as info:
        CheckpointStorage("nosuchfs://AKIAFAKE:FAKESECRET@bucket/jobs")
    assert "FAKESECRET" not in str(info.value) and "cannot open checkpoint storage" in str(
        info.value
    )


def test_postgres_sink_repr_and_errors_do_not_show_the_password() -> None:
    sink = PostgresSink(
        "postgresql://app:FAKE%PW@[db/shop",
        "totals",
        ["customer"],
        connect_kwargs={"password": "OTHERPW"},
    )
    assert "FAKE" not in repr(sink) and "OTHERPW" not in repr(sink)
    message = 'invalid percent-encoded token: "FAKE%PW"; password OTHERPW refused'
    cleaned = _without_secrets(message, sink)
    assert "FAKE%PW" not in cleaned and "OTHERPW" not in cleaned
