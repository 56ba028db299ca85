"""The soak benchmark's verdict rule: bounded = last third's max within tolerance of the middle
third's max (plus a small absolute slack); the first third is warm-up."""

from __future__ import annotations

from pathlib import Path

from benchmarks.soak_analysis import Series, judge, markdown_summary, plot, summary_rows, verdict


def ramp(values: list[float], duration: float = 90.0) -> list[tuple[float, float]]:
    step = duration / len(values)
    return [(i * step, v) for i, v in enumerate(values)]


def test_flat_series_after_warm_up_is_bounded() -> None:
    # warm-up climbs from 10 to 100, then flat: the first third does not count
    points = ramp([10, 50, 100, 100, 101, 100, 99, 100, 100])
    v = verdict(points, 90.0, "MiB")
    assert v["verdict"] == "bounded"
    assert v["middle_max"] == 101 and v["last_max"] == 100


def test_steady_growth_is_growing() -> None:
    points = ramp([100, 110, 120, 130, 140, 150, 160, 170, 180])
    v = verdict(points, 90.0, "MiB")
    assert v["verdict"] == "growing"
    assert v["last_max"] == 180 and v["middle_max"] == 150
    assert v["limit"] == 150 * 1.1 + 1.0


def test_tolerance_and_absolute_slack() -> None:
    # +10 % plus 1 MiB is allowed; one more is not
    at_limit = ramp([0, 0, 0, 100, 100, 100, 111, 111, 111])
    over = ramp([0, 0, 0, 100, 100, 100, 111.5, 100, 100])
    assert verdict(at_limit, 90.0, "MiB")["verdict"] == "bounded"
    assert verdict(over, 90.0, "MiB")["verdict"] == "growing"
    # a flat small count may gain two (a thread pool's extra thread) without "growing"
    assert verdict(ramp([5, 5, 5, 5, 5, 5, 7, 7, 7]), 90.0, "count")["verdict"] == "bounded"
    assert verdict(ramp([5, 5, 5, 5, 5, 5, 8, 8, 8]), 90.0, "count")["verdict"] == "growing"


def test_custom_tolerance() -> None:
    points = ramp([0, 0, 0, 100, 100, 100, 130, 130, 130])
    assert verdict(points, 90.0, "MiB", tolerance=0.10)["verdict"] == "growing"
    assert verdict(points, 90.0, "MiB", tolerance=0.30)["verdict"] == "bounded"


def test_too_few_samples_gives_no_verdict() -> None:
    assert verdict([(0.0, 1.0), (10.0, 1.0)], 90.0, "MiB")["verdict"] == "too few samples"
    assert verdict([], 90.0, "count")["verdict"] == "too few samples"


def test_judge_table_and_plot(tmp_path: Path) -> None:
    series = [
        Series("memory", "w0", "rss", "MiB", ramp([10, 80, 90, 90, 90, 90, 90, 90, 90])),
        Series("rocksdb", "job", "checkpoint_storage", "MiB", ramp([1, 2, 3, 4, 5, 6, 7, 8, 9])),
    ]
    judge(series, 90.0, 0.10)
    assert [s.verdict["verdict"] for s in series] == ["bounded", "growing"]
    rows = summary_rows(series)
    assert rows[0][0] == "memory w0" and rows[0][-1] == "bounded"
    assert series[1].to_json()["points"][-1] == [80.0, 9.0]
    png = plot(series, 90.0, tmp_path / "soak.png", "test")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_markdown_summary_marks_growing_series() -> None:
    series = [
        Series("memory", "w0", "rss", "MiB", ramp([10, 80, 90, 90, 90, 90, 90, 90, 90])),
        Series("memory", "job", "checkpoint_storage", "MiB", ramp([1, 2, 3, 4, 5, 6, 7, 8, 9])),
    ]
    judge(series, 90.0, 0.10)
    payload = {
        "config": {"rate": 1000.0, "keys": 100_000, "partitions": 4, "workers": 2},
        "machine": {"cpu": "CPU", "cores": 2, "ram_gb": 24.0, "python": "3.11"},
        "measured_at": "2026-11-22T15:40:00+00:00",
        "duration_s": 1800.0,
        "status": "ok",
        "command": "python -m benchmarks.soak --minutes 30",
        "series": [s.to_json() for s in series],
    }
    text = markdown_summary(payload, "soak.json", "soak.png")
    rows = [line for line in text.splitlines() if line.startswith("| memory")]
    assert rows[0].startswith("| memory | w0 | 90.0 MiB → 90.0 MiB |")  # workers first
    assert "6.0 MiB → 9.0 MiB **growing**" in rows[1]
    assert "![soak curves](results/soak.png)" in text
