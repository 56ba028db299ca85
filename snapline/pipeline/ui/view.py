"""What ``snapline ui`` shows, gathered from checkpoint storage, Kafka (optional) and the
workers' metrics endpoints (optional): a ``JobView`` value the page renders.

Threads: the HTTP server's request threads call ``ViewSource.collect``; its scrape memory
(for records/s) is guarded by a lock.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from snapline.connectors.config import redact_text
from snapline.pipeline.checkpoint.history import HistoryEntry, read_history
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.graph import Pipeline
from snapline.pipeline.status import TaskStatus, job_status

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EndpointSample:
    """One scrape of a worker's /metrics: per task records in, per partition lag."""

    url: str
    ok: bool
    at: float
    workers: frozenset[str] = frozenset()
    records_in: dict[str, float] = field(default_factory=dict)
    task_worker: dict[str, str] = field(default_factory=dict)
    #: Task id -> summed lag of its partitions.
    lag: dict[str, float] = field(default_factory=dict)
    error: str = ""


@dataclass(frozen=True)
class JobView:
    job: str
    storage: str
    kafka: str
    generated_at: float
    tasks: list[TaskStatus]
    history: list[HistoryEntry]
    endpoints: list[EndpointSample]
    #: Task id -> records/s between the last two scrapes (tasks of scraped workers only).
    rates: dict[str, float]
    errors: list[str]

    @property
    def workers(self) -> list[str]:
        """Workers named by metrics, the history or the tasks' last checkpoints."""
        names = {w for e in self.endpoints for w in e.workers}
        names |= {e.worker for e in self.history}
        for task in self.tasks:
            last = task.last_checkpoint
            if last is not None and last.worker:
                names.add(last.worker)
        return sorted(names)

    def task_worker(self, task_id: str) -> str:
        for sample in self.endpoints:
            if task_id in sample.task_worker:
                return sample.task_worker[task_id]
        task = next((t for t in self.tasks if t.task_id == task_id), None)
        last = task.last_checkpoint if task else None
        return last.worker if last else ""

    def lag_of(self, task: TaskStatus) -> float | None:
        """Kafka's committed lag when Kafka was asked; else the workers' reported lag."""
        if task.partitions:
            return task.lag
        values = [s.lag[task.task_id] for s in self.endpoints if task.task_id in s.lag]
        return sum(values) if values else None


class ViewSource:
    """Collects ``JobView``s for one job (see module docstring)."""

    def __init__(
        self,
        pipeline: Pipeline,
        storage: CheckpointStorage,
        kafka_config: dict[str, Any] | None = None,
        metrics_urls: list[str] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.storage = storage
        self.kafka_config = kafka_config
        self.metrics_urls = [_metrics_url(u) for u in metrics_urls or []]
        self._lock = threading.Lock()
        self._previous: dict[str, EndpointSample] = {}

    def collect(self) -> JobView:
        errors = []
        try:
            tasks = job_status(self.pipeline, self.kafka_config, self.storage)
        except Exception as exc:  # Kafka down: still show what storage holds
            errors.append(f"Kafka: {exc}")
            tasks = job_status(self.pipeline, None, self.storage)
        history = read_history(self.storage, self.pipeline.name)
        samples = [scrape(url) for url in self.metrics_urls]
        rates: dict[str, float] = {}
        with self._lock:
            for sample in samples:
                before = self._previous.get(sample.url)
                if sample.ok and before is not None and before.ok and sample.at > before.at:
                    for task_id, count in sample.records_in.items():
                        if task_id in before.records_in:
                            delta = count - before.records_in[task_id]
                            rates[task_id] = max(0.0, delta) / (sample.at - before.at)
                if sample.ok:
                    self._previous[sample.url] = sample
        errors += [f"metrics {s.url}: {s.error}" for s in samples if not s.ok]
        return JobView(
            job=self.pipeline.name,
            storage=redact_text(self.storage.uri),
            kafka=str(self.kafka_config.get("bootstrap.servers", "")) if self.kafka_config else "",
            generated_at=time.time(),
            tasks=tasks,
            history=history,
            endpoints=samples,
            rates=rates,
            errors=errors,
        )


def _metrics_url(text: str) -> str:
    url = text if "://" in text else f"http://{text}"
    return url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"


def scrape(url: str, timeout: float = 3.0) -> EndpointSample:
    """One worker's metrics (an unreachable endpoint is reported, not raised)."""
    from prometheus_client.parser import text_string_to_metric_families

    now = time.time()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode()
    except OSError as exc:
        return EndpointSample(url, False, now, error=str(exc))
    records: dict[str, float] = defaultdict(float)
    owner: dict[str, str] = {}
    lag: dict[str, float] = defaultdict(float)
    workers = set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = s.labels
            if "worker" in labels:
                workers.add(labels["worker"])
            if s.name == "snapline_records_in_total":
                records[labels["task"]] += s.value
            elif s.name == "snapline_consumer_lag_records":
                lag[labels["task"]] += s.value
                owner[labels["task"]] = labels["worker"]
            elif s.name == "snapline_state_entries":
                owner[labels["task"]] = labels["worker"]
    return EndpointSample(url, True, now, frozenset(workers), dict(records), owner, dict(lag))
