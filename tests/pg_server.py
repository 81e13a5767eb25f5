"""A private PostgreSQL server for the store's tests: a cluster in a temporary folder on a free loopback port, as
the Debian packages install it (`apt-get install postgresql`; `.ci/run` does). Started as the `postgres` user when
the tests run as root (PostgreSQL refuses root)."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid


def postgres_bin() -> str | None:
    """The folder of `initdb` and `pg_ctl`, or `None` when PostgreSQL is not installed."""
    for candidate in [os.environ.get("TRL_AGENTIC_PG_BIN"), *sorted(glob.glob("/usr/lib/postgresql/*/bin"))[::-1]]:
        if candidate and os.path.exists(os.path.join(candidate, "initdb")):
            return candidate
    found = shutil.which("initdb")
    return os.path.dirname(found) if found else None


class PostgresServer:
    def __init__(self):
        self.bin = postgres_bin()
        if self.bin is None:
            raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
        self.root = tempfile.mkdtemp(prefix="trl-agentic-pg-")
        self.data = os.path.join(self.root, "data")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.as_user = os.geteuid() == 0
        if self.as_user:
            shutil.chown(self.root, "postgres", "postgres")
            os.chmod(self.root, 0o755)

    def _run(self, *argv: str) -> None:
        command = (["runuser", "-u", "postgres", "--"] if self.as_user else []) + list(argv)
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)

    def start(self) -> PostgresServer:
        self._run(os.path.join(self.bin, "initdb"), "-D", self.data, "-A", "trust", "-U", "trl", "--no-sync")
        options = f"-k {self.root} -p {self.port} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            os.path.join(self.bin, "pg_ctl"), "-D", self.data, "-o", options, "-w", "-l", f"{self.root}/log", "start"
        )
        return self

    def new_database(self) -> str:
        """A fresh database's URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(f"postgresql://trl@127.0.0.1:{self.port}/postgres", autocommit=True) as db:
            db.execute(f"CREATE DATABASE {name}")
        return f"postgresql://trl@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        try:
            self._run(os.path.join(self.bin, "pg_ctl"), "-D", self.data, "-m", "immediate", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
