"""A throwaway local PostgreSQL server for the tests, the README and the demo.

It uses Debian's server binaries (``/usr/lib/postgresql/<version>/bin``, installed by
``scripts/install-postgres.sh``), runs ``initdb`` into a directory of its own and starts
``postgres`` on a free loopback port with trust authentication. Running as root it drops to the
``postgres`` OS user, because ``initdb`` and ``postgres`` refuse to run as root.

Threads: everything runs in the caller's thread. With ``die_with_parent`` (the default) the
server gets SIGINT (fast shutdown) when the *thread* that started it exits (Linux
``PR_SET_PDEATHSIG``), so a killed test run does not leave servers behind.

Command line (for people)::

    python -m snapline.connectors.local.postgres start --dir /tmp/snapline-pg   # prints the DSN
    python -m snapline.connectors.local.postgres stop --dir /tmp/snapline-pg
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import json
import logging
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from snapline.pipeline.errors import ConfigurationError, SinkError

__all__ = ["LocalPostgres", "find_postgres_bin", "stop_recorded_server"]

log = logging.getLogger(__name__)

STATE_FILE = "postgres.json"
DEFAULT_USER = "snapline"
DEFAULT_DATABASE = "snapline"
_INSTALL_HINT = "run `bash scripts/install-postgres.sh` (Debian: apt-get install postgresql)"
_PR_SET_PDEATHSIG = 1
_VERSION_DIR = re.compile(r"/usr/lib/postgresql/(\d+)(?:\.\d+)?/bin$")


def find_postgres_bin() -> Path:
    """The directory holding ``initdb``, ``postgres`` and ``pg_ctl``.

    ``$SNAPLINE_PG_BIN`` wins; otherwise the newest ``/usr/lib/postgresql/<version>/bin``.
    """
    override = os.environ.get("SNAPLINE_PG_BIN")
    if override:
        path = Path(override)
        if not (path / "initdb").is_file():
            raise ConfigurationError(
                f"SNAPLINE_PG_BIN={override!r} has no initdb; point it at a PostgreSQL bin "
                f"directory or unset it ({_INSTALL_HINT})"
            )
        return path
    found = []
    for initdb in glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        match = _VERSION_DIR.search(os.path.dirname(initdb))
        if match and os.access(initdb, os.X_OK):
            found.append((int(match.group(1)), Path(os.path.dirname(initdb))))
    if not found:
        raise ConfigurationError(
            f"PostgreSQL server binaries not found in /usr/lib/postgresql/*/bin: {_INSTALL_HINT}, "
            "or set SNAPLINE_PG_BIN to a directory with initdb and postgres"
        )
    return max(found)[1]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _server_user() -> pwd.struct_passwd | None:
    """The OS user the server runs as: None (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        raise ConfigurationError(
            "running as root, PostgreSQL must run as another OS user and `postgres` does not "
            f"exist: {_INSTALL_HINT} (the package creates it) or `useradd --system postgres`"
        ) from None


def _check_reachable(directory: Path, owner: pwd.struct_passwd) -> None:
    """The server's OS user must be able to enter every parent of its directory."""
    for parent in directory.resolve().parents:
        info = parent.stat()
        if info.st_uid != owner.pw_uid and not info.st_mode & 0o001:
            raise ConfigurationError(
                f"the PostgreSQL server runs as OS user {owner.pw_name!r}, which cannot enter "
                f"{parent} (mode {oct(info.st_mode & 0o777)}); put the directory elsewhere "
                f"(e.g. under /tmp) or `chmod o+x {parent}`"
            )


def _die_with_parent_hook(sig: int) -> Callable[[], None]:
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)

    def hook() -> None:
        # Runs in the child after Popen's setuid: prctl after the uid change keeps the signal.
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return hook


class LocalPostgres:
    """A PostgreSQL server in ``directory`` (a new temporary directory by default).

    ``start()`` runs initdb if the directory has no cluster yet, starts the server and creates
    the database; ``dsn`` then names it. ``stop()`` shuts the server down and deletes the
    directory if this object created it. Use it as a context manager.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        user: str = DEFAULT_USER,
        database: str = DEFAULT_DATABASE,
        die_with_parent: bool = True,
        settings: dict[str, str] | None = None,
        startup_timeout: float = 60.0,
    ) -> None:
        self._owns_directory = directory is None
        self.directory = Path(directory) if directory is not None else None
        self.port = port
        self.user = user
        self.database = database
        self.die_with_parent = die_with_parent
        self.settings = dict(settings or {})
        self.startup_timeout = startup_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file: int | None = None

    # ------------------------------------------------------------------ paths
    @property
    def data_dir(self) -> Path:
        return self._base() / "data"

    @property
    def log_path(self) -> Path:
        return self._base() / "postgres.log"

    @property
    def dsn(self) -> str:
        if self.port is None:
            raise SinkError("LocalPostgres has no port yet: call start() first")
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{self.database}"

    def _base(self) -> Path:
        if self.directory is None:
            raise SinkError("LocalPostgres has no directory yet: call start() first")
        return self.directory

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> LocalPostgres:
        bin_dir = find_postgres_bin()
        owner = _server_user()
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="snapline-postgres-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        if owner is not None:
            _check_reachable(self.directory, owner)
            os.chown(self.directory, owner.pw_uid, owner.pw_gid)
            self.directory.chmod(0o755)
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb(bin_dir, owner)
        attempts = 1 if self.port is not None else 3
        for attempt in range(attempts):
            port = self.port if self.port is not None else _free_port()
            try:
                self._start_server(bin_dir, owner, port)
                break
            except SinkError:
                # Another process may have taken the free port between probe and bind.
                if attempt == attempts - 1:
                    raise
                log.warning("PostgreSQL did not start on port %d, trying another port", port)
        self._create_database()
        self._write_state()
        log.info(
            "PostgreSQL %s running at %s (data in %s)", bin_dir.parent.name, self.dsn, self.data_dir
        )
        return self

    def _run_as(self, owner: pwd.struct_passwd | None) -> dict[str, Any]:
        if owner is None:
            return {}
        return {"user": owner.pw_uid, "group": owner.pw_gid, "extra_groups": []}

    def _initdb(self, bin_dir: Path, owner: pwd.struct_passwd | None) -> None:
        self.data_dir.mkdir(mode=0o700, exist_ok=True)
        if owner is not None:
            os.chown(self.data_dir, owner.pw_uid, owner.pw_gid)
        command = [
            str(bin_dir / "initdb"),
            "-D",
            str(self.data_dir),
            "-U",
            self.user,
            "-A",
            "trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        ]
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            check=False,
            cwd=self._base(),
            **self._run_as(owner),
        )
        if result.returncode != 0:
            raise SinkError(
                f"initdb failed (exit {result.returncode}) in {self.data_dir}: "
                f"{(result.stderr or result.stdout).strip()[-2000:]}"
            )

    def _start_server(self, bin_dir: Path, owner: pwd.struct_passwd | None, port: int) -> None:
        settings = {
            "listen_addresses": "127.0.0.1",
            "port": str(port),
            "unix_socket_directories": "",
            "max_connections": "200",
            "shared_buffers": "64MB",
            "fsync": "on",
            "synchronous_commit": "on",
            **self.settings,
        }
        command = [str(bin_dir / "postgres"), "-D", str(self.data_dir)]
        for name, value in settings.items():
            command += ["-c", f"{name}={value}"]
        log_fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if owner is not None:
            os.chown(self.log_path, owner.pw_uid, owner.pw_gid)
        kwargs = self._run_as(owner)
        if self.die_with_parent:
            kwargs["preexec_fn"] = _die_with_parent_hook(int(signal.SIGINT))
        else:
            kwargs["start_new_session"] = True
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=log_fd,
            cwd=self._base(),
            **kwargs,
        )
        os.close(log_fd)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if process.poll() is not None:
                raise SinkError(
                    f"PostgreSQL exited with code {process.returncode} while starting on port "
                    f"{port}; log {self.log_path}:\n{self._log_tail()}"
                )
            if self._answers(port):
                break
            if time.monotonic() > deadline:
                process.kill()
                process.wait()
                raise SinkError(
                    f"PostgreSQL did not accept connections on 127.0.0.1:{port} within "
                    f"{self.startup_timeout:.0f}s; log {self.log_path}:\n{self._log_tail()}"
                )
            time.sleep(0.1)
        self._process = process
        self.port = port

    def _answers(self, port: int) -> bool:
        import psycopg

        try:
            with psycopg.connect(
                host="127.0.0.1", port=port, user=self.user, dbname="postgres", connect_timeout=2
            ):
                return True
        except psycopg.OperationalError:
            return False

    def _create_database(self) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(
            host="127.0.0.1", port=self.port, user=self.user, dbname="postgres", autocommit=True
        ) as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (self.database,)
            ).fetchone()
            if exists is None:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.database)))

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text("utf-8", "replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _write_state(self) -> None:
        state = {
            "pid": self.pid,
            "port": self.port,
            "dsn": self.dsn,
            "data_dir": str(self.data_dir),
            "log": str(self.log_path),
        }
        (self._base() / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n", "utf-8")

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self, timeout: float = 30.0, keep_data: bool = False) -> None:
        """Fast shutdown (disconnects clients), then delete the directory if it is ours.

        ``keep_data``: keep the directory so ``start()`` brings the same database back on the
        same port (an outage, for tests).
        """
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._owns_directory and self.directory is not None and not keep_data:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> LocalPostgres:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def stop_recorded_server(directory: str | os.PathLike[str], timeout: float = 30.0) -> bool:
    """Stop the server a ``start --dir`` recorded in ``directory``; False if none was running."""
    state_path = Path(directory) / STATE_FILE
    try:
        state = json.loads(state_path.read_text("utf-8"))
    except (OSError, ValueError):
        return False
    pid = _recorded_pid(state)
    if pid is None:  # not running, or its pid now belongs to another process: never signal it
        state_path.unlink(missing_ok=True)
        return False
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        state_path.unlink(missing_ok=True)
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise SinkError(f"PostgreSQL (pid {pid}) did not stop within {timeout:.0f}s")
    state_path.unlink(missing_ok=True)
    return True


def _recorded_pid(state: dict[str, Any]) -> int | None:
    """The recorded server's pid if that server still runs: PostgreSQL's own
    ``postmaster.pid`` in the recorded data directory names the same pid. A state file left
    by a server that died (a reboot, a SIGKILL) names a pid the system may have given to any
    other process since."""
    try:
        pid = int(state["pid"])
        data_dir = str(state["data_dir"])
        lines = (Path(data_dir) / "postmaster.pid").read_text("utf-8").splitlines()
        if not lines or int(lines[0]) != pid:
            return None
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    # postmaster.pid outlives a server that was killed: the process must be that server, a
    # postgres started on this data directory (its command line, where /proc shows it).
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return pid if not Path("/proc/self").exists() else None
    if not any(b"postgres" in arg for arg in argv) or data_dir.encode() not in argv:
        return None
    return pid


def _recorded_running(directory: str) -> str | None:
    """The DSN of the server recorded in ``directory`` if it still runs."""
    try:
        state = json.loads((Path(directory) / STATE_FILE).read_text("utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or _recorded_pid(state) is None:
        return None
    return str(state["dsn"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m snapline.connectors.local.postgres",
        description="A throwaway local PostgreSQL for Snapline.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start (initdb on first use) and print the DSN")
    start.add_argument("--dir", required=True, help="cluster directory (kept between runs)")
    start.add_argument("--port", type=int, default=None, help="default: a free port")
    stop = sub.add_parser("stop", help="stop the server started with start --dir")
    stop.add_argument("--dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "start":
        running = _recorded_running(args.dir)
        if running is not None:
            print(running)
            return 0
        server = LocalPostgres(args.dir, port=args.port, die_with_parent=False)
        server.start()
        print(server.dsn)
        return 0
    stopped = stop_recorded_server(args.dir)
    print("stopped" if stopped else "no server was running")
    return 0


if __name__ == "__main__":
    sys.exit(main())
