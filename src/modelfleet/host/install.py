"""`modelfleet install systemd`: the fleet's processes as systemd services.

One unit per role (`modelfleet-control-plane.service`, `modelfleet-router.service`,
`modelfleet-agent.service`), each restarted whenever it exits (`Restart=always`), its working
directory `/var/lib/modelfleet` (made by systemd: `StateDirectory=`), run as a user of its
own (`modelfleet` by default, made by systemd-sysusers from the `sysusers.d` file written
beside the unit). A secret given among the role's options (the agent's `--token`) goes to an
environment file of mode 0600 (to live under /etc/modelfleet), not into the unit, which
anyone on the machine may read. An agent that joins with a join token is given that file
(`--env-file`, writable to it alone: `ReadWritePaths=`) and rewrites it without the token once
it holds a credential. The unit runs `modelfleet` by an absolute path, which its
user must be able to run: one under a home folder of another user is refused.

The agent's unit stops its agent only (`KillMode=process`): engines outlive their agent in this
project (the next agent adopts them), and systemd's default would kill every process of the
unit's cgroup, engines included, at each restart or upgrade of the agent.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Role = Literal["control-plane", "router", "agent"]
ROLES: tuple[Role, ...] = ("control-plane", "router", "agent")

# What each role's command needs (each entry: one of those options), and the options whose
# value is a secret (moved to the environment file as the variable the command reads it from).
_NEEDED: dict[Role, tuple[tuple[str, ...], ...]] = {
    "control-plane": (("--config",),),
    "router": (("--config",),),
    "agent": (("--join", "--control-plane"), ("--node",)),
}
_SECRETS: dict[Role, dict[str, str]] = {
    "control-plane": {},
    "router": {},
    "agent": {"--token": "MODELFLEET_AGENT_TOKEN"},
}
_DESCRIPTIONS: dict[Role, str] = {
    "control-plane": "modelfleet control plane (agent and admin APIs, reconcile loop)",
    "router": "modelfleet router (OpenAI-compatible client API)",
    "agent": "modelfleet agent (reports this node's GPUs, runs its engines)",
}


# What every unit may not do (`systemd-analyze security` scores it): gain privileges, write
# outside its state dir and its own /tmp, keep a capability, make sockets but IP, Unix and
# netlink ones (glibc's getaddrinfo asks netlink), touch the kernel's settings.
_HARDENING = [
    "NoNewPrivileges=yes",
    "ProtectSystem=strict",
    "ReadWritePaths=/var/lib/modelfleet",
    "PrivateTmp=yes",
    "UMask=0077",
    "CapabilityBoundingSet=",
    "AmbientCapabilities=",
    "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK",
    "SystemCallArchitectures=native",
    "ProtectKernelTunables=yes",
    "ProtectKernelModules=yes",
    "ProtectKernelLogs=yes",
    "ProtectControlGroups=yes",
    "ProtectClock=yes",
    "ProtectHostname=yes",
    "RestrictNamespaces=yes",
    "RestrictRealtime=yes",
    "RestrictSUIDSGID=yes",
    "LockPersonality=yes",
    "KeyringMode=private",
    "RemoveIPC=yes",
    "ProtectProc=invisible",
]
# The control plane and the router need no device, no home folder, and no system call a
# service does not make.
_SERVICE_HARDENING = [
    "ProtectHome=yes",
    "PrivateDevices=yes",
    "DevicePolicy=closed",
    "ProcSubset=pid",
    "SystemCallFilter=@system-service",
    "SystemCallErrorNumber=EPERM",
]
# The agent's engines read model files (which may live under /home), need the GPUs, and make
# system calls no list foresees (JIT compilers, NUMA binding): no filter for them.
_AGENT_HARDENING = [
    "ProtectHome=read-only",
    "DevicePolicy=closed",
    "DeviceAllow=/dev/nvidiactl rw",
    "DeviceAllow=/dev/nvidia-uvm rw",
    "DeviceAllow=/dev/nvidia-uvm-tools rw",
    "DeviceAllow=char-nvidia-frontend rw",
    "DeviceAllow=char-nvidia-caps rw",
]


class InstallError(Exception):
    """Options that cannot make a working unit; the message says which and what to do."""


SERVICE_USER = "modelfleet"  # the user a unit runs as unless told otherwise
ENV_DIR = Path("/etc/modelfleet")  # where a unit's environment file lives by default


@dataclass(frozen=True)
class Unit:
    """A role's unit file, and its environment file when it has secrets."""

    name: str  # modelfleet-ROLE.service
    text: str
    env_name: str | None = None
    env_text: str = ""
    user: str | None = None  # the user it runs as (None: root)


def systemd_unit(
    role: Role,
    options: list[str],
    env_dir: Path,
    program: list[str] | None = None,
    user: str | None = SERVICE_USER,
) -> Unit:
    """The unit running `modelfleet ROLE OPTIONS` as `user` (None: root); its environment
    file, when it has one, is named as living in `env_dir`. `program`: how `modelfleet` is
    run (by default this Python, `-m modelfleet`)."""
    if role not in ROLES:
        raise InstallError(f"no role {role!r}: one of {', '.join(ROLES)}")
    kept, secrets = _split_secrets(role, options)
    given = {option.split("=", 1)[0] for option in kept if option.startswith("--")}
    missing = [
        " or ".join(one_of) if len(one_of) == 1 else f"({' or '.join(one_of)})"
        for one_of in _NEEDED[role]
        if not given & set(one_of)
    ]
    if missing:
        raise InstallError(
            f"the {role} needs {' and '.join(missing)} among its options (after `--`), as "
            f"`modelfleet {role}` does"
        )
    name = f"modelfleet-{role}.service"
    env_name = f"modelfleet-{role}.env" if secrets else None
    forgets = role == "agent" and env_name is not None and "--join" in given
    if forgets:  # the agent rewrites its env file without the join token once it joined
        kept += ["--env-file", str(env_dir / f"modelfleet-{role}.env")]
    command = [*(program or [sys.executable, "-m", "modelfleet"]), role, *kept]
    service = [
        "Type=simple",
        *([f"User={user}", f"Group={user}"] if user else []),
        "StateDirectory=modelfleet",
        "WorkingDirectory=/var/lib/modelfleet",
        *([f"EnvironmentFile={env_dir / env_name}"] if env_name else []),
        *([f"ReadWritePaths=-{env_dir / f'modelfleet-{role}.env'}"] if forgets else []),
        "ExecStart=" + " ".join(_quoted(arg) for arg in command),
        "Restart=always",
        "RestartSec=2",
        # SIGTERM, then the service's own ordered shutdown (in-flight requests finish).
        "TimeoutStopSec=60",
        "LimitNOFILE=65536",
    ]
    service += _HARDENING
    if role == "agent":
        # Engines outlive their agent: only the agent is stopped (see the module's docstring).
        service.append("KillMode=process")
        service += _AGENT_HARDENING
    else:
        service += _SERVICE_HARDENING
    text = "\n".join(
        [
            "[Unit]",
            f"Description={_DESCRIPTIONS[role]}",
            "After=network-online.target",
            "Wants=network-online.target",
            "",
            "[Service]",
            *service,
            "",
            "[Install]",
            "WantedBy=multi-user.target",
            "",
        ]
    )
    env_text = "".join(f"{variable}={_env_quoted(value)}\n" for variable, value in secrets.items())
    return Unit(name, text, env_name, env_text, user)


def sysusers(user: str) -> str:
    """A `sysusers.d` file that makes `user` (a system user and group of its own, its home
    the services' state dir, no login shell), for /etc/sysusers.d/."""
    return f'u {user} - "modelfleet services" /var/lib/modelfleet /usr/sbin/nologin\n'


def check_runnable(path: Path, user: str | None) -> None:
    """InstallError unless `user` (None: root) can run the file at `path`: an absolute path,
    every folder above it open to others (a home folder of 0700 is not), the file executable
    by others. Ownership is not looked at: a file only its owner may run is refused too."""
    if not path.is_absolute():
        raise InstallError(f"{path}: a unit names its program by an absolute path")
    if user is None:
        return
    try:
        mode = path.stat().st_mode
        if not mode & 0o001:
            raise InstallError(f"{path} is not executable by others ({oct(mode & 0o777)})")
        for folder in path.parents:
            if not folder.stat().st_mode & 0o001:
                raise InstallError(
                    f"the user {user} cannot run {path}: {folder} is closed to others. Install "
                    "modelfleet where every user may run it (in this repository: `python3 -m venv "
                    "/opt/modelfleet && /opt/modelfleet/bin/pip install .`) and give `--program "
                    "/opt/modelfleet/bin/modelfleet`, or run the unit as root (`--user root`)"
                )
    except OSError as exc:
        raise InstallError(f"cannot check that {user} may run {path}: {exc}") from exc


def write_unit(unit: Unit, out: Path) -> list[Path]:
    """Write `unit` (0644) and its environment file (0600) into `out`; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    unit_file = out / unit.name
    unit_file.write_text(unit.text)
    unit_file.chmod(0o644)
    written = [unit_file]
    if unit.user is not None:
        (out / "sysusers.d").mkdir(exist_ok=True)
        users_file = out / "sysusers.d" / f"{unit.user}.conf"
        users_file.write_text(sysusers(unit.user))
        users_file.chmod(0o644)
        written.append(users_file)
    if unit.env_name is not None:
        env_file = out / unit.env_name
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(unit.env_text)
        env_file.chmod(0o600)
        written.append(env_file)
    return written


def _split_secrets(role: Role, options: list[str]) -> tuple[list[str], dict[str, str]]:
    """The options without their secrets, and the secrets by environment variable."""
    secret_options = _SECRETS[role]
    kept: list[str] = []
    secrets: dict[str, str] = {}
    i = 0
    while i < len(options):
        option = options[i]
        name, sep, value = option.partition("=")
        if name in secret_options:
            if not sep:
                if i + 1 >= len(options):
                    raise InstallError(f"{name} needs a value")
                value = options[i + 1]
                i += 1
            if "\n" in value:
                raise InstallError(f"{name}: a value on one line")
            secrets[secret_options[name]] = value
        else:
            kept.append(option)
        i += 1
    return kept, secrets


def _env_quoted(value: str) -> str:
    """`value` in double quotes, as systemd's environment files read them."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _quoted(arg: str) -> str:
    """`arg` as one word of a systemd command line: specifiers (%) and variables ($) kept
    literal, quoted when it holds a space or a quote."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and not any(c in arg for c in " \t\"'\\"):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
