"""The soak benchmark's short version (issue 9, item 9): ``python -m benchmarks.soak
--minutes 0.5`` against the session's broker, both backends, two workers each. Asserts that the
samples were taken for every worker and series, that the verdict rule ran on each, that both
jobs committed checkpoints and that the JSON and the plot were written. No performance
threshold: the 30-minute numbers are in benchmarks/README.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from examples.workers import child_pythonpath

REPO = Path(__file__).resolve().parent.parent
SOAK_TIMEOUT = 240  # 30 s of soak + broker topics, 4 worker starts and stops (40 s grace)


def test_soak_smoke(kafka_bootstrap: str, tmp_path: Path) -> None:
    output = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.soak",
            "--minutes",
            "0.5",
            "--sample-seconds",
            "2.5",
            "--rate",
            "500",
            "--bootstrap-servers",
            kafka_bootstrap,
            "--output",
            str(output),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=SOAK_TIMEOUT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    payload = json.loads(output.read_text())
    assert payload["status"] == "ok", payload["problems"]
    workers = {(w["backend"], w["worker"]) for w in payload["workers"]}
    assert workers == {(b, w) for b in ("memory", "rocksdb") for w in ("w0", "w1")}
    for w in payload["workers"]:
        assert w["checkpoints_committed"] > 0, w
    series = {(s["backend"], s["worker"], s["metric"]): s for s in payload["series"]}
    expected = {
        (b, w, m) for b, w in workers for m in ("rss", "threads", "open_files", "local_state")
    } | {(b, "job", m) for b in ("memory", "rocksdb") for m in ("checkpoint_storage", "lag")}
    assert set(series) == expected
    for key, s in series.items():
        # one sample every 2.5 s for 30 s; a slow start may cost one or two
        assert len(s["points"]) >= 8, (key, s["points"])
        assert s["verdict"]["verdict"] in ("bounded", "growing"), (key, s["verdict"])
        assert s["verdict"]["middle_points"] >= 2 and s["verdict"]["last_points"] >= 2
    rss = [v for _t, v in series[("rocksdb", "w0", "rss")]["points"]]
    assert max(rss) > 20, rss  # a live Python worker, read from /proc, not a placeholder
    assert (output.with_suffix(".png")).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert payload["plot"] == "soak.png"
