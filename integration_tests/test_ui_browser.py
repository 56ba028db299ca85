"""``snapline ui`` in a real headless browser (Debian's chromium + chromium-driver, driven by
selenium): a job runs, restarts from its checkpoint and takes a savepoint; the page's job
overview shows it, and its checkpoint history and stored checkpoints equal what checkpoint
storage holds. The test saves a screenshot (``SNAPLINE_UI_SCREENSHOT`` names where; the one in
docs/images/ui.png was taken this way)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from examples.orders import create_topics, produce_orders
from examples.workers import WorkerProcess, child_pythonpath
from snapline.pipeline.checkpoint.history import read_history
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.status import stored_checkpoints, stored_task_ids

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parent.parent
SPEC = "examples.running_total:pipeline"
PARTITIONS = 2


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _chromium() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.fail(
            "the browser test needs Debian's chromium and chromium-driver: "
            "apt-get install chromium chromium-driver",
            pytrace=False,
        )
    return browser, driver


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = _chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1500,1300")
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(what: str, predicate: Any, timeout: float, logs: list[Path]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.3)
    tails = "\n".join(
        "\n".join(p.read_text(errors="replace").splitlines()[-30:]) for p in logs if p.exists()
    )
    raise AssertionError(f"{what}: not within {timeout} s\n{tails}")


def _cells(row: Any) -> dict[str, Any]:
    from selenium.webdriver.common.by import By

    return {td.get_attribute("data-col"): td for td in row.find_elements(By.XPATH, "./td")}


def test_ui_page_shows_what_checkpoint_storage_holds(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    prefix = f"{unique_name}-"
    job = f"{unique_name}-job"
    create_topics(
        kafka_bootstrap, {f"{prefix}orders": PARTITIONS, f"{prefix}customer-totals": PARTITIONS}
    )
    produce_orders(kafka_bootstrap, f"{prefix}orders", 3000, customers=50)
    checkpoint_dir = tmp_path / "chk"
    storage = CheckpointStorage(str(checkpoint_dir))
    env = {"SNAPLINE_EXAMPLE_PREFIX": prefix, "SNAPLINE_EXAMPLE_JOB": job}
    env["SNAPLINE_EXAMPLE_INTERVAL"] = "0.5"
    metrics_port = _free_port()
    worker = WorkerProcess(SPEC, "w0", kafka_bootstrap, checkpoint_dir, tmp_path, env)
    ui_port = _free_port()
    ui_log = tmp_path / "ui.log"
    ui = None
    logs = [worker.log_path, ui_log]

    def completed() -> int:
        return sum(
            1
            for e in read_history(storage, job)
            if e.kind == "checkpoint" and e.status == "completed"
        )

    try:
        worker.start(extra_args=["--metrics-port", str(metrics_port)])
        _wait("a completed checkpoint", lambda: completed() >= 1, 90, logs)
        # An idle job takes no checkpoints: more input, more checkpoints.
        produce_orders(kafka_bootstrap, f"{prefix}orders", 1000, customers=50, start_id=5000)
        _wait("two completed checkpoints", lambda: completed() >= 2, 90, logs)
        # A restart restores the committed checkpoint: a restore row in the history.
        assert worker.stop(60) == 0, worker.tail()
        before = completed()
        produce_orders(kafka_bootstrap, f"{prefix}orders", 500, customers=50, start_id=3000)
        worker.start(extra_args=["--metrics-port", str(metrics_port)])
        _wait("a checkpoint after the restart", lambda: completed() > before, 90, logs)
        savepoint = subprocess.run(
            [
                sys.executable,
                "-m",
                "snapline.pipeline.cli",
                "savepoint",
                "create",
                SPEC,
                "--bootstrap-servers",
                kafka_bootstrap,
                "--checkpoint-dir",
                str(checkpoint_dir),
                "--timeout",
                "60",
            ],
            cwd=tmp_path,
            env={**os.environ, **env, "PYTHONPATH": child_pythonpath()},
            capture_output=True,
            timeout=120,
        )
        assert savepoint.returncode == 0, savepoint.stderr.decode()[-3000:]

        with open(ui_log, "wb") as out:
            ui = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "snapline.pipeline.cli",
                    "ui",
                    SPEC,
                    "--port",
                    str(ui_port),
                    "--checkpoint-dir",
                    str(checkpoint_dir),
                    "--bootstrap-servers",
                    kafka_bootstrap,
                    "--metrics",
                    f"127.0.0.1:{metrics_port}",
                ],
                cwd=tmp_path,
                env={**os.environ, **env, "PYTHONPATH": child_pythonpath()},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        url = f"http://127.0.0.1:{ui_port}/?refresh=0"

        def answers() -> bool:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    return response.status == 200
            except OSError:
                return False

        _wait("the ui to answer", answers, 60, logs)

        # While the job runs: the overview names the worker, its tasks and partitions.
        browser.get(url)
        assert browser.find_element(By.ID, "job").text == job
        assert browser.find_element(By.ID, "workers").text == "w0"
        tasks = browser.find_elements(By.CSS_SELECTOR, "tr.task-row")
        assert [r.get_attribute("data-task") for r in tasks] == [f"p{i}" for i in range(PARTITIONS)]
        for row in tasks:
            cells = _cells(row)
            assert cells["worker"].text == "w0"
            assert cells["lag"].text.isdigit(), cells["lag"].text
        card = browser.find_element(By.CSS_SELECTOR, '[data-card="partitions"] .v')
        assert card.text == str(PARTITIONS)
        time.sleep(1.5)
        browser.get(url)  # a second scrape: records/s known
        rates = [
            _cells(r)["rate"].text for r in browser.find_elements(By.CSS_SELECTOR, "tr.task-row")
        ]
        assert all(r != "—" for r in rates), rates

        screenshot = Path(os.environ.get("SNAPLINE_UI_SCREENSHOT") or tmp_path / "ui.png")
        browser.get(url)  # while the job runs: the overview has its metrics
        browser.set_window_size(1500, 1300)
        assert browser.save_screenshot(str(screenshot))
        assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

        # Stopped: storage no longer changes, and the page must show exactly what it holds.
        assert worker.stop(60) == 0, worker.tail()
        browser.get(url)
        history = read_history(storage, job)
        rows = browser.find_elements(By.CSS_SELECTOR, "#history tr.history-row")
        shown = []
        for row in rows:
            c = _cells(row)
            shown.append(
                (
                    row.get_attribute("data-kind"),
                    int(c["id"].get_attribute("data-value")),
                    c["worker"].text,
                    c["status"].text,
                    float(c["time"].get_attribute("data-value")),
                    int(c["bytes"].get_attribute("data-value")),
                )
            )
        expected = [(e.kind, e.checkpoint_id, e.worker, e.status, e.time, e.bytes) for e in history]
        assert shown == expected
        kinds = {(k, s) for k, _i, _w, s, _t, _b in shown}
        assert {("checkpoint", "completed"), ("restore", "restored"), ("savepoint", "paused")} <= (
            kinds
        ), kinds
        restores = [e for e in history if e.kind == "restore"]
        assert any(e.checkpoint_id > 0 for e in restores)  # the restart restored a checkpoint
        # Per-task times of a completed checkpoint, in its details.
        first = next(r for r in rows if r.get_attribute("data-status") == "completed")
        first.find_element(By.TAG_NAME, "summary").click()
        details = first.find_elements(By.CSS_SELECTOR, "details tr[data-task]")
        assert {d.get_attribute("data-task") for d in details} <= {
            f"p{i}" for i in range(PARTITIONS)
        } and details

        stored = [
            (task_id, c.ref.checkpoint_id, c.ref.attempt, c.bytes)
            for task_id in stored_task_ids(storage, job)
            for c in reversed(stored_checkpoints(storage, job, task_id))
        ]
        retained = [
            (
                r.get_attribute("data-task"),
                int(_cells(r)["id"].get_attribute("data-value")),
                _cells(r)["attempt"].text,
                int(_cells(r)["bytes"].get_attribute("data-value")),
            )
            for r in browser.find_elements(By.CSS_SELECTOR, "#retained tr.retained-row")
        ]
        assert retained == stored and stored
        completed_ids = {
            i for k, i, _w, s, _t, _b in shown if (k, s) == ("checkpoint", "completed")
        }
        assert {task_id_ck[1] for task_id_ck in stored} <= completed_ids

    finally:
        worker.kill()
        if ui is not None:
            ui.send_signal(signal.SIGINT)
            try:
                ui.wait(20)
            except subprocess.TimeoutExpired:
                ui.kill()
                ui.wait(10)
