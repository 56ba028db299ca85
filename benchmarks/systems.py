"""The systems a benchmark run compares, and how to start each one as a process."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from benchmarks.profiling import profiled_argv
from benchmarks.verifier import Mode

Role = Literal["baseline", "peer", "snapline"]


@dataclass(frozen=True)
class System:
    """One benchmarked configuration.

    ``args`` may contain ``{bootstrap}``, replaced when the process is started.
    """

    name: str
    label: str
    role: Role
    module: str
    args: tuple[str, ...] = ()
    mode: Mode = "total"
    exactly_once: bool = True
    backend: str = "memory"
    guarantee: str = "exactly_once"
    notes: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)
    # The program takes ``--profile-to PATH`` and profiles itself (a Snapline worker ends with
    # os._exit, so an outer ``python -m pyinstrument`` would never save its session).
    profiles_itself: bool = False

    def argv(self, bootstrap: str, profile_to: Path | None = None) -> list[str]:
        args = [a.replace("{bootstrap}", bootstrap) for a in self.args]
        if profile_to is not None and self.profiles_itself:
            return [sys.executable, "-m", self.module, "--profile-to", str(profile_to), *args]
        if profile_to is not None:
            return profiled_argv(self.module, args, profile_to)
        return [sys.executable, "-m", self.module, *args]


BASELINE_A = System(
    name="baseline-a", label="baseline A: confluent-kafka, transactions", role="baseline",
    module="benchmarks.baselines", args=("--transactions",),
    notes="read_committed consume(10k) → dict total → produce; one transaction per second "
          "with send_offsets_to_transaction",
)
BASELINE_B = System(
    name="baseline-b", label="baseline B: confluent-kafka, no transactions", role="baseline",
    module="benchmarks.baselines", args=("--no-transactions",), exactly_once=False,
    guarantee="at_least_once",
    notes="the same loop; every second flush the producer, then commit offsets",
)
QUIX = System(
    name="quix", label="Quix Streams 3.x exactly-once", role="peer",
    module="benchmarks.quix_peer",
    notes='sdf.apply(stateful=True), processing_guarantee="exactly-once", commit_interval=1.0',
)
QUIX_GROUP_BY = System(
    name="quix-group-by", label="Quix Streams 3.x group_by, exactly-once", role="peer",
    module="benchmarks.quix_peer", args=("--group-by",),
    notes='sdf.group_by(customer) (repartition topic) → sdf.apply(stateful=True), '
          'processing_guarantee="exactly-once", commit_interval=1.0',
)
