"""The dev PostgreSQL's state file (``python -m snapline.connectors.local.postgres stop``): a
pid recorded by a server that is gone is never signalled."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

from snapline.connectors.local.postgres import STATE_FILE, _recorded_running, stop_recorded_server


def test_a_stale_state_file_never_signals_the_process_that_now_has_its_pid(
    tmp_path: Path,
) -> None:
    """The server died (a reboot, a SIGKILL) and its pid went to another process: stop sent
    that process SIGINT. Now the pid must match PostgreSQL's postmaster.pid in the recorded
    data directory, or the state is stale and only deleted."""
    data_dir = tmp_path / "data"
    # SIGINT handled explicitly, and only signalled once the handler is set ("ready"): a
    # shell's background job (as CI may run) starts with SIGINT ignored, and Python keeps it.
    sleep = [
        sys.executable,
        "-c",
        "import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "print('ready', flush=True); time.sleep(60)",
    ]
    other = subprocess.Popen(sleep, stdout=subprocess.PIPE)
    # A stand-in for the server: a process whose command line names postgres and the data dir.
    server = subprocess.Popen([*sleep, "postgres", "-D", str(data_dir)], stdout=subprocess.PIPE)
    for process in (other, server):
        assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    try:
        data_dir.mkdir()
        state = {"pid": other.pid, "port": 1, "dsn": "postgresql://x", "data_dir": str(data_dir)}
        (tmp_path / STATE_FILE).write_text(json.dumps(state))
        assert _recorded_running(str(tmp_path)) is None
        assert stop_recorded_server(tmp_path, timeout=2) is False
        assert other.poll() is None, "an unrelated process was signalled"
        assert not (tmp_path / STATE_FILE).exists()
        # Another server's postmaster.pid in that directory: still not this pid.
        (data_dir / "postmaster.pid").write_text(f"{other.pid + 1}\n{data_dir}\n")
        (tmp_path / STATE_FILE).write_text(json.dumps(state))
        assert stop_recorded_server(tmp_path, timeout=2) is False
        assert other.poll() is None
        # A killed server leaves its postmaster.pid: the pid matches, the process is not it.
        (data_dir / "postmaster.pid").write_text(f"{other.pid}\n{data_dir}\n")
        (tmp_path / STATE_FILE).write_text(json.dumps(state))
        assert _recorded_running(str(tmp_path)) is None
        assert stop_recorded_server(tmp_path, timeout=2) is False
        assert other.poll() is None, "an unrelated process was signalled"
        # The recorded server itself: it is stopped.
        (data_dir / "postmaster.pid").write_text(f"{server.pid}\n{data_dir}\n")
        (tmp_path / STATE_FILE).write_text(json.dumps({**state, "pid": server.pid}))
        assert _recorded_running(str(tmp_path)) == "postgresql://x"
        reaper = threading.Thread(target=server.wait)  # our child: reaped, so its pid goes
        reaper.start()
        assert stop_recorded_server(tmp_path, timeout=10) is True
        reaper.join(10)
        assert server.returncode not in (None, 0)
        assert other.poll() is None
    finally:
        for process in (other, server):
            process.kill()
            process.wait()
