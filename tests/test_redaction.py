"""Secrets never reach logs, events or error messages: credentials in checkpoint URIs and
PostgreSQL DSNs, and secret-named Kafka settings."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from snapline.connectors.config import RedactingFilter, redact, redact_text
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import CheckpointError, ConfigurationError
from snapline.sinks import PostgresSink
from snapline.sinks.postgres import _without_secrets

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("checkpoints s3://AKIAFAKE:FAKESECRET@bucket/jobs", "checkpoints s3://***@bucket/jobs"),
        ("s3://AKIAFAKE:wJalr/K7MD/FAKE@bucket/jobs: no", "s3://***@bucket/jobs: no"),
        ("'postgresql://app:p@ss/w@rd@db/shop' refused", "'postgresql://***@db/shop' refused"),
        ('in URI: "postgresql://app:FAKEPW@[db/shop"', 'in URI: "postgresql://***@[db/shop"'),
        ("host=db password=FAKEPW user=app", "host=db password=*** user=app"),
        ("host=db password='FAKE PW' user=app", "host=db password=*** user=app"),
        (
            "s3://b/p?region=eu&secret_key=FAKE&access_key=AK",
            "s3://b/p?region=eu&secret_key=***&access_key=***",
        ),
        (
            "kafka_config=mappingproxy({'bootstrap.servers': 'b:9092', 'sasl.password': 'FAKE'})",
            "kafka_config=mappingproxy({'bootstrap.servers': 'b:9092', 'sasl.password': '***'})",
        ),
        (
            '{"ssl.key.password": "FA\\"KE", "acks": "all"}',
            '{"ssl.key.password": "***", "acks": "all"}',
        ),
        ("{'user': 'app', 'note': 'a: b'}", "{'user': 'app', 'note': 'a: b'}"),
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
    # A malformed DSN is refused at start; libpq's message quotes the password's token.
    with pytest.raises(ConfigurationError, match="dsn is not valid") as refused:
        PostgresSink("postgresql://app:FAKE%PW@[db/shop", "totals", ["customer"])
    assert "FAKE" not in str(refused.value)
    sink = PostgresSink(
        "postgresql://app:FAKE%25PW@db/shop",
        "totals",
        ["customer"],
        connect_kwargs={"password": "OTHERPW"},
    )
    assert "FAKE" not in repr(sink) and "OTHERPW" not in repr(sink)
    message = 'password "FAKE%25PW" refused; password OTHERPW refused'
    cleaned = _without_secrets(message, sink)
    assert "FAKE%25PW" not in cleaned and "OTHERPW" not in cleaned


def test_a_secret_with_a_slash_is_not_quoted_by_storage_errors() -> None:
    """An AWS secret key with a ``/`` pasted unencoded: pyarrow cannot parse the URI, and
    its message repeats it; the redaction stopped at the first ``/`` of the secret."""
    with pytest.raises(CheckpointError) as info:
        CheckpointStorage("s3://AKIAFAKE:FAKE/SECRET+x@bucket/jobs")
    assert "SECRET" not in str(info.value) and "AKIAFAKE" not in str(info.value)
    assert "cannot open checkpoint storage" in str(info.value)


def test_checkpoint_storage_errors_do_not_quote_credentials() -> None:
    from snapline.pipeline.checkpoint.metadata import CheckpointRef
    from snapline.pipeline.runtime.coordinator import CheckpointCoordinator
    from snapline.pipeline.runtime.faults import FaultInjector

    storage = CheckpointStorage("s3://AKIAFAKE:FAKESECRET@bucket/jobs?region=us-east-1")
    coordinator = CheckpointCoordinator("job", "w", storage, FaultInjector(), states=[], timeout=1)
    error = coordinator._storage_error("write", CheckpointRef(3, "abcd1234"), OSError("down"))
    assert "FAKESECRET" not in str(error) and "AKIAFAKE" not in str(error)
    assert "s3://***@bucket/jobs" in str(error)


def test_a_kafka_config_of_the_wrong_type_is_refused_without_showing_it() -> None:
    from types import MappingProxyType

    from snapline import Pipeline
    from snapline.pipeline.errors import ConfigurationError

    config = MappingProxyType({"bootstrap.servers": "b:9092", "sasl.password": "FAKE"})
    with pytest.raises(ConfigurationError) as info:
        Pipeline("orders", kafka_config=config)  # type: ignore[arg-type]
    assert "FAKE" not in str(info.value) and "mappingproxy" in str(info.value)


def test_cli_errors_and_uncaught_tracebacks_are_redacted(tmp_path: Path) -> None:
    """What a command ends with is printed by Click (or by Python, uncaught), not logged:
    both are redacted."""
    module = tmp_path / "leaky_job.py"
    module.write_text(
        "from snapline import Pipeline\n"
        "pipeline = Pipeline('leaky', checkpoint_dir='nosuchfs://AKIAFAKE:FAKESECRET@b/j')\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    done = subprocess.run(
        [sys.executable, "-m", "snapline.pipeline.cli", "status", "leaky_job:pipeline"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 1 and "cannot open checkpoint storage" in done.stderr
    assert "FAKESECRET" not in done.stderr + done.stdout, done.stderr
    hook = (
        "from snapline.connectors.config import install_redaction\n"
        "install_redaction()\n"
        "raise RuntimeError('could not write s3://AKIAFAKE:FAKESECRET@b/j')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", hook], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 1 and "RuntimeError" in done.stderr
    assert "FAKESECRET" not in done.stderr and "s3://***@b/j" in done.stderr, done.stderr


#: A checkpoint dir with credentials, as given in SNAPLINE_CHECKPOINT_DIR (out of ``ps``);
#: ``mock://`` is a pyarrow filesystem in memory: no network.
LEAKY_DIR = "mock://AKIAFAKE:FAKESECRET@bucket/ckpt"


@pytest.fixture
def leaky_cli(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``snapline`` in-process (CliRunner) with a checkpoint dir holding credentials, Kafka
    and the savepoint export replaced by fakes: the commands' printed output is checked."""
    from types import SimpleNamespace

    import confluent_kafka.admin
    from click.testing import CliRunner

    from snapline.pipeline.cli import main
    from snapline.pipeline.savepoint import control, export

    monkeypatch.chdir(REPO)  # the example job's module
    monkeypatch.setenv("SNAPLINE_EXAMPLE_JOB", "leaky")
    monkeypatch.setenv("SNAPLINE_CHECKPOINT_DIR", LEAKY_DIR)
    monkeypatch.setenv("SNAPLINE_BOOTSTRAP_SERVERS", "localhost:1")
    monkeypatch.setattr(confluent_kafka.admin, "AdminClient", lambda config: None)
    monkeypatch.setattr(export, "active_members", lambda admin, job: 1)
    monkeypatch.setattr(export, "wait_until_stopped", lambda admin, job: 0)
    monkeypatch.setattr(export, "topic_partitions", lambda *args: {})
    monkeypatch.setattr(export, "job_tasks", lambda *args: [])
    empty = SimpleNamespace(pipeline="leaky", operators=[], in_flight=[])
    monkeypatch.setattr(export, "export_savepoint", lambda *args, **kwargs: empty)
    monkeypatch.setattr(control, "ensure_control_topic", lambda *args: None)
    monkeypatch.setattr(control, "send", lambda *args: None)
    monkeypatch.setattr(control, "holding", lambda *args: contextlib.nullcontext())
    acks = {"w0": {"status": "committed", "tasks": []}}
    monkeypatch.setattr(control, "read_acks", lambda *args: acks)

    def invoke(*args: str) -> tuple[str, str]:
        result = CliRunner().invoke(main, list(args), catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.stdout, result.stderr

    return invoke


def test_savepoint_commands_print_paths_without_credentials(leaky_cli: Any) -> None:
    """Found by review: what the CLIs print does not pass the log's redacting filter, and
    they printed savepoint URIs as given; a default savepoint URI is built from the checkpoint
    dir, credentials included (and SNAPLINE_CHECKPOINT_DIR keeps them out of ``ps``)."""
    spec = "examples.running_total:build"
    for command in ("create", "from-checkpoint"):
        out, err = leaky_cli("savepoint", command, spec)
        assert "FAKESECRET" not in out + err and "AKIAFAKE" not in out + err, out + err
        assert out.startswith("mock://***@bucket/ckpt/leaky/savepoints/sp-"), out
        if command == "create":
            said = " ".join(err.split())  # as rich wraps it
            assert "writing mock://***@bucket/ckpt/leaky/savepoints/sp-" in said, err
    out, err = leaky_cli("savepoint", "from-checkpoint", spec, "--path", f"{LEAKY_DIR}/mine")
    assert out == "mock://***@bucket/ckpt/mine\n", out + err


def test_savepoint_delete_prints_the_uri_without_credentials(
    leaky_cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(CheckpointStorage, "exists", lambda self, path: True)
    monkeypatch.setattr(CheckpointStorage, "delete_dir", lambda self, path: None)
    out, err = leaky_cli("savepoint", "delete", f"{LEAKY_DIR}/sp")
    assert out == "deleted mock://***@bucket/ckpt/sp\n", out + err


def test_spark_run_prints_its_savepoint_without_credentials(
    leaky_cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from snapline.pipeline.spark import bounded

    def run_bounded(*args: Any, progress: Any, savepoint_out: Any, **kwargs: Any) -> Any:
        target = savepoint_out or f"{args[2]}/leaky/savepoints/sp-1"
        progress(f"savepoint at the end offsets: {target}")
        return bounded.RunResult("r1", {}, target, 1.0, 0)

    monkeypatch.setattr(bounded, "run_bounded", run_bounded)
    out, err = leaky_cli("spark", "run", "examples.running_total:build")
    assert "FAKESECRET" not in out + err and "AKIAFAKE" not in out + err, out + err
    assert out == "mock://***@bucket/ckpt/leaky/savepoints/sp-1\n", out + err
    assert "savepoint at the end offsets: mock://***@bucket/ckpt/leaky/savepoints/sp-1" in err


def test_redaction_is_linear_in_a_long_token() -> None:
    """Where a match failed, the pattern rescanned a token from every ``scheme://`` in it: a
    150 KB comma-joined list of URIs took 1.5 s per redaction, and the log filter redacts
    every record. Counted in regex steps, not timed: the callback sees each URI once."""
    from snapline.connectors import config

    calls = []
    original = config._userinfo

    def counting(match):  # type: ignore[no-untyped-def]
        calls.append(1)
        return original(match)

    text = ",".join(f"s3://bucket/path{i}" for i in range(8000))
    config._URI_USERINFO.sub(counting, text)
    assert len(calls) == 1  # one token, one match, whatever the number of URIs in it
    assert redact_text(text) == text
