"""What a soak run's samples say: the series, the "bounded" verdict per series, and the plot.

The rule (also in benchmarks/README.md): the run is cut into thirds by time; the first third
is warm-up (keys still appearing, caches and buffers filling). A series is **bounded** when the
maximum of its last third is at most the maximum of its middle third times ``1 + tolerance``
plus a small absolute slack (``SLACK`` per unit: a thread or two, a few file descriptors, a
MiB of files), so that a series that is flat at a small value does not fail on one extra
thread. Otherwise it is **growing**. Fewer than ``MIN_POINTS`` samples in the middle or the last
third give **too few samples** (no verdict).

Pure functions, no Kafka: unit-tested in tests/benchmarks/test_soak_analysis.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_TOLERANCE = 0.10
MIN_POINTS = 1

#: (metric, unit, label) of every per-worker series, in plot order.
WORKER_METRICS: tuple[tuple[str, str, str], ...] = (
    ("rss", "MiB", "RSS"),
    ("threads", "count", "threads"),
    ("open_files", "count", "open files (fds)"),
    ("local_state", "MiB", "local state directory"),
)
#: The per-job series (both workers share one checkpoint storage).
JOB_METRICS: tuple[tuple[str, str, str], ...] = (
    ("checkpoint_storage", "MiB", "checkpoint storage"),
    ("lag", "records", "consumer lag"),
)

#: Absolute slack per unit on top of the relative tolerance (a lag of a few seconds of input
#: comes and goes with each checkpoint's commit).
SLACK: dict[str, float] = {"MiB": 1.0, "count": 2.0, "records": 5000.0}


@dataclass
class Series:
    """One metric of one worker (or of the job, ``worker`` = "job") over time."""

    backend: str
    worker: str
    metric: str
    unit: str
    points: list[tuple[float, float]] = field(default_factory=list)  # (seconds, value)
    verdict: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.backend}/{self.worker}/{self.metric}"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["points"] = [[round(t, 1), round(v, 3)] for t, v in self.points]
        return data


def verdict(
    points: Sequence[tuple[float, float]],
    duration: float,
    unit: str,
    tolerance: float = DEFAULT_TOLERANCE,
) -> dict[str, Any]:
    """Apply the module's rule to ``points`` sampled over ``[0, duration]`` seconds."""
    middle = [v for t, v in points if duration / 3 <= t < 2 * duration / 3]
    last = [v for t, v in points if t >= 2 * duration / 3]
    result: dict[str, Any] = {
        "rule": f"max(last third) <= max(middle third) * {1 + tolerance:g} + {SLACK[unit]:g} "
        f"{unit}",
        "middle_points": len(middle),
        "last_points": len(last),
    }
    if len(middle) < MIN_POINTS or len(last) < MIN_POINTS:
        return {**result, "verdict": "too few samples"}
    middle_max = max(middle)
    last_max = max(last)
    limit = middle_max * (1 + tolerance) + SLACK[unit]
    growth = (last_max - middle_max) / middle_max if middle_max else None
    return {
        **result,
        "verdict": "bounded" if last_max <= limit else "growing",
        "middle_max": round(middle_max, 3),
        "last_max": round(last_max, 3),
        "limit": round(limit, 3),
        "growth": None if growth is None else round(growth, 4),
    }


def judge(series: list[Series], duration: float, tolerance: float) -> None:
    for s in series:
        s.verdict = verdict(s.points, duration, s.unit, tolerance)


def summary_rows(series: list[Series]) -> list[tuple[str, ...]]:
    """Rows of the printed table: series, first / middle max / last max, verdict."""
    rows = []
    for s in series:
        v = s.verdict
        first = s.points[0][1] if s.points else None
        rows.append(
            (
                f"{s.backend} {s.worker}",
                s.metric,
                _fmt(first, s.unit),
                _fmt(v.get("middle_max"), s.unit),
                _fmt(v.get("last_max"), s.unit),
                str(v.get("verdict", "")),
            )
        )
    return rows


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "–"
    return f"{value:,.1f} MiB" if unit == "MiB" else f"{value:,.0f}"


def plot(series: list[Series], duration: float, path: Path, title: str) -> Path | None:
    """One panel per metric, one line per worker (per job for checkpoint storage); dashed
    lines mark the thirds. Returns None when matplotlib is not installed (the `bench` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    metrics = [*WORKER_METRICS, *JOB_METRICS]
    fig, axes = plt.subplots(len(metrics), 1, figsize=(10, 2.6 * len(metrics)), sharex=True)
    for ax, (metric, unit, label) in zip(axes, metrics, strict=True):
        for s in series:
            if s.metric != metric or not s.points:
                continue
            xs = [t / 60 for t, _ in s.points]
            ys = [v for _, v in s.points]
            mark = "" if s.verdict.get("verdict") == "bounded" else " (growing)"
            ax.plot(xs, ys, label=f"{s.backend} {s.worker}{mark}", linewidth=1.2)
        for third in (duration / 3, 2 * duration / 3):
            ax.axvline(third / 60, color="grey", linestyle="--", linewidth=0.8)
        ax.set_ylabel(f"{label}\n[{unit}]" if unit == "MiB" else label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right")
    axes[-1].set_xlabel("minutes since the workers started")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def markdown_summary(payload: dict[str, Any], json_name: str, png_name: str | None) -> str:
    """The README section of a run: one row per worker (and per job), one column per metric;
    a cell is "middle-third max → last-third max", marked when the series is growing."""
    config = payload["config"]
    machine = payload["machine"]
    metrics = [*WORKER_METRICS, *JOB_METRICS]
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for s in payload["series"]:
        v = s["verdict"]
        if "last_max" in v:
            cell = f"{_fmt(v['middle_max'], s['unit'])} → {_fmt(v['last_max'], s['unit'])}"
            if v["verdict"] != "bounded":
                cell += f" **{v['verdict']}**"
        else:
            cell = str(v.get("verdict", "–"))
        rows.setdefault((s["backend"], s["worker"]), {})[s["metric"]] = cell
    lines = [
        f"Measured {payload['measured_at']} on {machine['cpu']}, {machine['cores']} cores, "
        f"{machine['ram_gb']:.0f} GB RAM, Python {machine['python']}: "
        f"{payload['duration_s'] / 60:.1f} min, {config['rate']:,.0f} records/s per job, "
        f"{config['keys']:,} keys, {config['partitions']} partitions, "
        f"{config['workers']} workers per backend, status {payload['status']}:",
        "",
        f"`{payload['command']}`",
        "",
        "| backend | worker | " + " | ".join(label for _, _, label in metrics) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in metrics) + " |",
    ]
    for (backend, worker), cells in sorted(
        rows.items(), key=lambda kv: (kv[0][0], kv[0][1] == "job", kv[0][1])
    ):
        lines.append(
            f"| {backend} | {worker} | "
            + " | ".join(cells.get(metric, "") for metric, _, _ in metrics)
            + " |"
        )
    lines += ["", "Cells: max of the middle third → max of the last third."]
    links = f"Raw results: [`results/{json_name}`](results/{json_name})"
    if png_name:
        links += f"; plot: [`results/{png_name}`](results/{png_name})\n\n"
        links += f"![soak curves](results/{png_name})"
    lines += ["", links]
    return "\n".join(lines)
