"""A throwaway PostgreSQL server for the tests of shared studies (`tests/test_distributed.py`).

`Server.start()` makes a cluster with `initdb` in a fresh folder under the system's temporary folder and
runs it on 127.0.0.1 at a free port, with its Unix socket in the same folder. The programs are found on
PATH, else where Debian's `postgresql` package puts them (`/usr/lib/postgresql/<version>/bin`).
PostgreSQL refuses to run as root: as root the cluster belongs to the `postgres` user and every command
runs as that user (`runuser`). `missing()` says why no server can start here (the tests skip with it).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PROGRAMS = ("initdb", "pg_ctl", "postgres")
USER = "postgres"  # who runs the server when the tests run as root


def program(name: str) -> str | None:
    """The path of PostgreSQL's program `name`, or None."""
    found = shutil.which(name)
    if found is None:
        versions = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
                          key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
        found = versions[-1] if versions else None
    return found


def missing() -> str | None:
    """Why a server cannot start here, or None."""
    absent = [p for p in PROGRAMS if program(p) is None]
    if absent:
        return f"PostgreSQL is not installed ({', '.join(absent)} not on PATH; e.g. apt-get install postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(USER)
        except KeyError:
            return f"running as root and there is no {USER!r} user to run PostgreSQL as"
        if shutil.which("runuser") is None:
            return "running as root without runuser to run PostgreSQL as another user"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "no PostgreSQL driver: pip install 'ring-tuner[distributed]'"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One PostgreSQL cluster: `start`, `stop`, `url(database)`, `create(database)`."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="ring-tuner-pg-"))
        self.data, self.log = self.root / "data", self.root / "server.log"
        self.port = free_port()
        self.as_root = os.geteuid() == 0
        if self.as_root:
            entry = pwd.getpwnam(USER)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)

    def _run(self, *command: str, timeout: float = 60) -> subprocess.CompletedProcess:
        prefix = ["runuser", "-u", USER, "--"] if self.as_root else []
        done = subprocess.run([*prefix, program(command[0]) or command[0], *command[1:]], capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}\n"
                               f"{self.log.read_text() if self.log.exists() else ''}")
        return done

    def start(self) -> Server:
        """Make the cluster on first use, then start the server and wait until it accepts connections."""
        if not self.data.exists():
            self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                   f"-c max_connections=200")
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.log), "-w", "start")
        return self

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def destroy(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def create(self, database: str) -> str:
        """A new empty database; its URL."""
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres",
                             autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{database}"')
        return self.url(database)


def wait_for(condition, timeout: float, every: float = 0.1):
    """Poll `condition()` until it returns something true (returned) or `timeout` seconds pass (None)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(every)
    return None
