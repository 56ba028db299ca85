"""Job identity: which job and which Kafka cluster a checkpoint directory or a sink's commit
log belongs to, so a job pointed at another cluster is refused instead of mixing two histories.

Committed Kafka offsets name the checkpoint to restore; on another cluster (a fresh embedded
broker, a failover cluster, a recreated one) the same group has no such offsets, and a worker
that trusted the absence would start from scratch beside the old checkpoints and append a
second history to the sinks. The first worker of a job records ``{"job", "cluster_id"}``
(checksummed: a changed byte is reported as corruption, not as "another cluster"); every later
start compares and stops on a mismatch with a message saying what differs.

Threads: the task thread, at start and when a task (and its sink writers) opens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from snapline.pipeline.checkpoint.metadata import decode_checked, encode_checked
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import CheckpointError, ConfigurationError

IDENTITY_FILE = "_job.json"


@dataclass(frozen=True)
class JobIdentity:
    """A job (the pipeline name: consumer group, transactional ids) on one Kafka cluster."""

    job: str
    cluster_id: str

    def to_json(self) -> bytes:
        return encode_checked({"job": self.job, "cluster_id": self.cluster_id})

    @staticmethod
    def from_json(data: bytes, where: str) -> JobIdentity:
        """The recorded identity; CorruptCheckpointError if the file fails its checksum (one
        written before checksums, a bare ``{"job", "cluster_id"}``, is still read)."""
        body: Any = decode_checked(data, where, legacy_key="cluster_id")
        try:
            return JobIdentity(str(body["job"]), str(body["cluster_id"]))
        except (KeyError, TypeError) as exc:
            raise CheckpointError(f"{where} is not a Snapline job identity file: {exc}") from exc

    def check(
        self, recorded: JobIdentity, where: str, bootstrap: str = "this worker's Kafka"
    ) -> None:
        """Raise a ConfigurationError naming the difference if ``recorded`` is another job's."""
        if recorded == self:
            return
        if recorded.job != self.job:
            raise ConfigurationError(
                f"{where} belongs to job {recorded.job!r}, not {self.job!r}: give each pipeline "
                "its own checkpoint directory and sink tables"
            )
        raise ConfigurationError(
            f"{where} holds job {self.job!r} as it ran on Kafka cluster {recorded.cluster_id}, "
            f"but {bootstrap} is cluster {self.cluster_id}. Its committed offsets live on the "
            "first cluster, so continuing here would start over beside the old checkpoints and "
            "write a second history into the sinks. Point --bootstrap-servers at the cluster "
            "the job ran on; to start this job afresh on this cluster, use a new checkpoint "
            "directory and new sink tables (or a new pipeline name)."
        )


def check_storage_identity(
    storage: CheckpointStorage, identity: JobIdentity, bootstrap: str
) -> None:
    """Record ``identity`` in the job's checkpoint directory, or verify the one recorded."""
    path = f"{identity.job}/{IDENTITY_FILE}"
    if storage.exists(path):
        recorded = JobIdentity.from_json(storage.read_bytes(path), storage.full_path(path))
        identity.check(
            recorded, f"checkpoint directory {storage.full_path(identity.job)}", bootstrap
        )
        return
    storage.write_bytes(path, identity.to_json())
