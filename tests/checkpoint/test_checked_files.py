"""Small JSON files with a checksum (the id floor, the Spark runners' pre-commit records, the
job identity)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from snapline.pipeline.checkpoint.identity import (
    IDENTITY_FILE,
    JobIdentity,
    check_storage_identity,
)
from snapline.pipeline.checkpoint.metadata import (
    ID_FLOOR_FILE,
    decode_checked,
    encode_checked,
    raise_id_floor,
    read_id_floor,
)
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import ConfigurationError, CorruptCheckpointError


def test_a_checked_file_round_trips_and_a_changed_byte_is_detected() -> None:
    body = {"sinks": {"table": {"files": ["a.parquet", "b.parquet"]}}}
    data = encode_checked(body)
    assert decode_checked(data, "record") == body
    corrupt = data.replace(b"a.parquet", b"c.parquet")
    with pytest.raises(CorruptCheckpointError, match="record failed its checksum"):
        decode_checked(corrupt, "record")
    with pytest.raises(CorruptCheckpointError, match="record is not valid"):
        decode_checked(data[:-3], "record")


def test_a_record_written_before_checksums_is_read_only_where_allowed() -> None:
    legacy = orjson.dumps({"sinks": {"table": None}})
    assert decode_checked(legacy, "record", "sinks") == {"sinks": {"table": None}}
    with pytest.raises(CorruptCheckpointError):
        decode_checked(legacy, "record")


def test_the_id_floor_only_rises_and_its_corruption_is_detected(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path))
    assert read_id_floor(storage, "job") is None
    raise_id_floor(storage, "job", 17)
    raise_id_floor(storage, "job", 5)
    assert read_id_floor(storage, "job") == 17
    path = tmp_path / "job" / ID_FLOOR_FILE
    path.write_bytes(path.read_bytes().replace(b"17", b"12"))
    with pytest.raises(CorruptCheckpointError, match="failed its checksum"):
        read_id_floor(storage, "job")


def test_a_changed_job_identity_is_corruption_not_another_cluster(tmp_path: Path) -> None:
    """One changed byte of the recorded cluster id was reported as "the job ran on another
    cluster" (and the fix offered: a new checkpoint directory); now it fails its checksum."""
    storage = CheckpointStorage(str(tmp_path))
    identity = JobIdentity("orders", "cluster-AAAA")
    check_storage_identity(storage, identity, "kafka:9092")
    check_storage_identity(storage, identity, "kafka:9092")  # recorded, then verified
    path = tmp_path / "orders" / IDENTITY_FILE
    path.write_bytes(path.read_bytes().replace(b"AAAA", b"AAAB"))
    with pytest.raises(CorruptCheckpointError, match="failed its checksum"):
        check_storage_identity(storage, identity, "kafka:9092")
    path.write_bytes(orjson.dumps({"job": "orders", "cluster_id": "cluster-AAAA"}))
    check_storage_identity(storage, identity, "kafka:9092")  # written before checksums
    with pytest.raises(ConfigurationError, match="is cluster other"):
        check_storage_identity(storage, JobIdentity("orders", "other"), "kafka:9092")
