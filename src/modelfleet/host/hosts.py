"""Several hosts on one machine, to try and test a fleet across machines: network namespaces.

`Hosts` makes one network namespace per host, each with one address on a private subnet,
joined by a bridge in a namespace of its own (nothing is added to the machine's own
namespace), and removes all of it again. `Shell` is a bash session on one host that commands
are typed into, as an operator would: what they start in the background stays in the
session's process group, which is ended, by its id, when done. `shell_blocks` reads the
commands of a README section. Needs root (`ip netns`): the multi-host test and
bench/multihost.py use it.
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, TypeVar

import psutil

PREFIX_BITS = 24  # the subnet's
T = TypeVar("T")


def netns_unavailable() -> str | None:
    """Why this machine cannot make network namespaces for a test, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"mfprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` is not allowed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=True)
    return None


class HostsFailed(RuntimeError):
    """An `ip` command, or a shell, did not do what was asked; the message says which."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise HostsFailed(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Hosts:
    """Network namespaces standing in for hosts: name -> its address on one subnet."""

    def __init__(self, addresses: dict[str, str]) -> None:
        self.addresses = addresses
        self.tag = secrets.token_hex(2)
        self.switch = f"mf{self.tag}sw"
        self.made: list[str] = []

    def netns(self, host: str) -> str:
        return f"mf{self.tag}{host}"

    def make(self) -> None:
        _ip("netns", "add", self.switch)
        self.made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for host, address in self.addresses.items():
            ns = self.netns(host)
            _ip("netns", "add", ns)
            self.made.append(ns)
            veth = f"mf{self.tag}{host}"  # the host's end; its peer is plugged into the bridge
            _ip("link", "add", veth, "netns", ns, "type", "veth", "peer", "name", f"{veth}s",
                "netns", self.switch)  # fmt: skip
            _ip("-n", self.switch, "link", "set", f"{veth}s", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{address}/{PREFIX_BITS}", "dev", veth)
            _ip("-n", ns, "link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def link(self, host: str, up: bool) -> None:
        """Cut `host` off the network (its link down), or plug it back in."""
        veth = f"mf{self.tag}{host}s"
        _ip("-n", self.switch, "link", "set", veth, "up" if up else "down")

    def remove(self) -> None:
        """Remove every namespace made (their links go with them)."""
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made.clear()

    def left(self) -> list[str]:
        """The namespaces of these hosts that still exist."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [line.split()[0] for line in listed.splitlines() if f"mf{self.tag}" in line]

    def __enter__(self) -> Hosts:
        try:
            self.make()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()
        if self.left():
            raise RuntimeError(f"network namespaces left behind: {self.left()}")


_CLONE_NEWNET = 0x40000000


def call_in(netns: str, work: Callable[[], T]) -> T:
    """`work()` run on a thread of its own moved into network namespace `netns`: a network
    namespace is a thread's own, so the sockets it opens there (an httpx client made inside
    `work`) are on that host's network, and nothing else of this process moves."""
    done: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            try:
                if _libc().setns(fd, _CLONE_NEWNET) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"setns into {netns}: {os.strerror(errno)}")
            finally:
                os.close(fd)
            done.append(work())
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, name=f"in {netns}")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return done[0]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def shell_blocks(markdown: str, heading: str) -> list[str]:
    """The ```sh blocks of the section of `markdown` under `## heading`, in order."""
    start = markdown.index(f"## {heading}\n")
    end = markdown.find("\n## ", start + 1)
    section = markdown[start : end if end >= 0 else len(markdown)]
    return re.findall(r"```sh\n(.*?)```", section, flags=re.S)


class Shell:
    """A bash session on one host, in a folder of its own, typed into."""

    def __init__(self, netns: str, folder: Path, env: dict[str, str] | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.log = folder / "shell.log"
        self._out: IO[bytes] = self.log.open("ab")
        clean = {k: v for k, v in os.environ.items() if not k.startswith("MODELFLEET_")}
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", netns, "bash", "--norc", "--noprofile"],
            stdin=subprocess.PIPE,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            cwd=folder,
            env={**clean, **(env or {})},
            start_new_session=True,
        )
        self._count = 0
        # A command that fails says so in the log, with the command: `run` raises on it.
        self.type("trap 'echo \"FAILED($?): $BASH_COMMAND\"' ERR", timeout=10)

    def type(self, commands: str, timeout: float) -> str:
        """Type `commands` and wait (up to `timeout` seconds) until the shell has run them;
        returns what they printed (and what the session's background services logged to
        the terminal meanwhile)."""
        assert self.proc.stdin is not None
        self._count += 1
        marker = f"__typed_{self._count}__"
        start = self.log.stat().st_size
        self.proc.stdin.write(f"{commands}\necho {marker}\n".encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log.read_bytes()[start:].decode(errors="replace")
            if f"{marker}\n" in text:
                return text[: text.index(marker)]
            if self.proc.poll() is not None:
                raise HostsFailed(f"the shell exited ({self.proc.returncode}): {text[-2000:]}")
            time.sleep(0.05)
        raise HostsFailed(f"the shell did not finish within {timeout}s: {commands[:200]}")

    def run(self, commands: str, timeout: float = 120) -> str:
        """`type`; raises HostsFailed if any command failed."""
        out = self.type(commands, timeout)
        if "FAILED(" in out:
            raise HostsFailed(f"a command failed:\n{out[-3000:]}")
        return out

    def members(self) -> list[psutil.Process]:
        """The processes of the session's group: the shell and what it started in the
        background (engines start groups of their own)."""
        found = []
        for proc in psutil.process_iter():
            try:
                if os.getpgid(proc.pid) == self.proc.pid:
                    found.append(proc)
            except (ProcessLookupError, psutil.Error):
                continue
        return found

    def end(self, grace: float = 20) -> None:
        """End the session and everything it started: SIGTERM to each process of its group,
        `grace` seconds, then SIGKILL to what is left."""
        members = self.members()
        for proc in members:
            try:
                proc.terminate()
            except psutil.NoSuchProcess:
                continue
        _, alive = psutil.wait_procs(members, timeout=grace)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                continue
        psutil.wait_procs(alive, timeout=10)
        self.proc.wait(timeout=10)
        self._out.close()


class Capture:
    """tcpdump on one host's links to the others (loopback left out: there an agent reaches
    its own engines): what crossed the network while the capture ran, in `captured()`.
    Needs tcpdump (Debian's package)."""

    def __init__(self, netns: str, file: Path) -> None:
        self.file = file
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", netns, "tcpdump", "-i", "any", "-U", "-s", "0",
             "-w", str(file), "tcp and not net 127.0.0.0/8"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        assert self.proc.stderr is not None
        heard = b""
        for _ in range(5):  # "listening on any, ..." once it captures (lines before it vary)
            heard += self.proc.stderr.readline()
            if b"listening" in heard:
                return
        self.stop()
        raise HostsFailed(f"tcpdump in {netns} did not start: {heard.decode(errors='replace')}")

    def stop(self) -> bytes:
        """End the capture (by its process group); every byte it wrote (packet headers
        included: search it for what must not be there)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return self.file.read_bytes() if self.file.exists() else b""
