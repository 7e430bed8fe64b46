"""A PostgreSQL server of modelfleet's own, in a folder: Debian's PostgreSQL (`initdb`,
`pg_ctl`), listening on 127.0.0.1 only, with a database and a password of its own. The tests
start one for the PostgreSQL store (`start`, through pg_ctl); `up --store postgres` runs one in
its state dir as a process of its fleet (`init`, `server_command`, `create_database`).

PostgreSQL refuses to run as root: run as root, the server runs as the `postgres` user
(`runuser` for its one-shot programs, `setpriv` for the server `up` runs), and its folder is
handed to that user, which must be able to reach it (a folder under a private one, such as
pytest's temporary folders, it cannot).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from modelfleet.host.processes import free_port

DATABASE = "modelfleet"
USER = "modelfleet"
RUN_AS = "postgres"  # the user the server runs as when we are root


class PgServerError(RuntimeError):
    """No PostgreSQL server could be made or started here; says why and what to install."""


def bin_dir() -> Path:
    """Where Debian's PostgreSQL programs are (the newest version installed)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if found:
        return found[-1].parent
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    raise PgServerError(
        "PostgreSQL's initdb is not installed: apt-get install postgresql (Debian's), or "
        "give the control plane a store of your own (store: postgresql://...)"
    )


@dataclass
class PgServer:
    """A server whose data lives in `folder`; `start` makes it on first use."""

    folder: Path
    port: int = 0

    @property
    def data(self) -> Path:
        return self.folder / "data"

    @property
    def password_file(self) -> Path:
        return self.folder / "password"

    def conninfo(self) -> str:
        password = self.password_file.read_text().strip()
        return f"postgresql://{USER}:{password}@127.0.0.1:{self.port}/{DATABASE}"

    def _run(self, *argv: str, what: str) -> str:
        command = list(argv)
        if os.geteuid() == 0:
            command = ["runuser", "-u", RUN_AS, "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise PgServerError(f"{what} failed ({done.returncode}): {done.stderr.strip()[-800:]}")
        return done.stdout

    def start(self) -> str:
        """Make the server if its folder has none, start it, and return its conninfo."""
        bins = bin_dir()
        fresh = self.init()
        self.port = self.port or free_port("127.0.0.1")
        self._run(
            str(bins / "pg_ctl"), "-D", str(self.data), "-l", str(self.data / "server.log"),
            "-o", " ".join(self._options()), "-w", "-t", "60", "start",
            what="pg_ctl start",
        )  # fmt: skip
        if fresh:
            self.create_database()
        return self.conninfo()

    def _options(self) -> list[str]:
        return ["-c", "listen_addresses=127.0.0.1", "-p", str(self.port), "-k", str(self.data)]

    def server_command(self) -> list[str]:
        """The server in the foreground (as the `postgres` user when we are root), on
        `port`: for a process manager to run, stop (SIGTERM: once its clients are gone) and
        restart. `setpriv` becomes the server (it execs); `runuser` stayed its parent, and
        once the server had been stopped (SIGSTOP) and continued, runuser stopped itself as
        su does and never reaped it: the server's exit went unseen."""
        command = [str(bin_dir() / "postgres"), "-D", str(self.data), *self._options()]
        if os.geteuid() != 0:
            return command
        become = [f"--reuid={RUN_AS}", f"--regid={RUN_AS}", "--init-groups"]
        return ["setpriv", *become, "--", *command]

    def init(self) -> bool:
        """Make the server's files if its folder has none; returns whether it made them (then
        `create_database` once it runs)."""
        bins = bin_dir()
        self.folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.folder, 0o700)
        if os.geteuid() == 0:
            shutil.chown(self.folder, RUN_AS, RUN_AS)
        fresh = not (self.data / "PG_VERSION").exists()
        if fresh:
            password = secrets.token_urlsafe(24)
            pwfile = self.folder / "initdb-password"
            pwfile.write_text(password + "\n")
            if os.geteuid() == 0:
                shutil.chown(pwfile, RUN_AS, RUN_AS)
            os.chmod(pwfile, 0o600)
            try:
                self._run(
                    str(bins / "initdb"), "-D", str(self.data), "-U", USER, "--pwfile",
                    str(pwfile), "-A", "scram-sha-256", "-E", "UTF8", "--no-instructions",
                    what="initdb",
                )  # fmt: skip
            finally:
                pwfile.unlink(missing_ok=True)
            self.password_file.write_text(password + "\n")
            os.chmod(self.password_file, 0o600)
        return fresh

    def create_database(self) -> None:
        """The database of modelfleet in the running server (there already: nothing)."""
        bins = bin_dir()
        env = {**os.environ, "PGPASSWORD": self.password_file.read_text().strip()}
        deadline = time.monotonic() + 30
        while True:
            done = subprocess.run(
                [str(bins / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", USER,
                 DATABASE],
                capture_output=True, text=True, timeout=60, env=env, check=False,
            )  # fmt: skip
            if done.returncode == 0 or "already exists" in done.stderr:
                return
            if time.monotonic() > deadline:
                raise PgServerError(f"createdb failed: {done.stderr.strip()[-800:]}")
            time.sleep(0.2)

    def pids(self) -> list[int]:
        """The server's processes: the postmaster and every process it started (sessions,
        writers). Empty when it does not run. Freezing them all (SIGSTOP) is a server that
        takes connections and answers nothing, as a host that hangs."""
        try:
            postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
            parent = psutil.Process(postmaster)
            return [postmaster, *(c.pid for c in parent.children(recursive=True))]
        except (OSError, ValueError, IndexError, psutil.Error):
            return []

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (`mode`: smart, fast or immediate, as pg_ctl says)."""
        with contextlib.suppress(PgServerError, FileNotFoundError):
            self._run(
                str(bin_dir() / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop",
                what="pg_ctl stop",
            )  # fmt: skip


def redacted(conninfo: str) -> str:
    """`conninfo` without its password, for messages and logs."""
    if "://" not in conninfo:
        return " ".join(p for p in conninfo.split() if not p.startswith("password="))
    parts = urlsplit(conninfo)
    if parts.password is None:
        return conninfo
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return parts._replace(netloc=netloc).geturl()
