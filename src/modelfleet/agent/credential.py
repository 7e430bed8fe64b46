"""The agent's side of joining: a join token exchanged once for a credential of its node.

`join` pins the fleet's CA by the fingerprint the token carries (it fetches the CA's
certificate over a connection it does not trust yet, and refuses it unless the fingerprint
matches), then sends the token, over TLS checked against that CA, with a certificate request
for its own admin listener; the answer is its node's credential and that certificate. All of it
is kept in one file of the agent's state dir, readable by its owner alone, and every later run
uses it instead of the token (which may have expired or been used up by then).

Once it holds a credential the control plane takes, the agent forgets the token (`HeldToken`):
it drops it from its settings, from its environment (`os.environ`: what every process it
starts inherits), and from the files it was given it in (`--token-file`, and `--env-file`,
the environment file its service reads), each rewritten in place without the lines that
hold it. What a process cannot do: the kernel keeps the environment and the command line it
was started with (`/proc/PID/environ`, `/proc/PID/cmdline`, readable by its user and root)
until it exits, and copies the interpreter made while reading its options stay in its memory
until reused. A file it may not write (owned by root, on a read-only file system) keeps the
token: the agent says so in its log, naming the file.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import MutableMapping
from pathlib import Path

import httpx
from cryptography import x509
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from modelfleet.host.files import write_atomic
from modelfleet.messages.wire import JoinAnswer, JoinRequest
from modelfleet.security.joining import JoinToken
from modelfleet.security.pki import PkiError, TlsFiles, client_context, pinned_ca, request

log = logging.getLogger("modelfleet.agent")

CREDENTIAL_FILE = "credential.json"  # in the agent's state dir, 0600
ADMIN_TLS_STEM = "admin"  # admin.crt and admin.key beside it
FLEET_CA_FILE = "fleet-ca.crt"  # the fleet's CA, for its engines' gates


class HeldToken:
    """The join token an agent was given, held until it holds a credential the control
    plane takes, then forgotten (`forget`) wherever the agent can reach it. Every copy of
    the agent's settings shares one: forgotten in one, it is gone from all."""

    def __init__(
        self,
        token: str | None = None,
        files: tuple[Path, ...] = (),
        environ: MutableMapping[str, str] = os.environ,
    ) -> None:
        self._token = token.strip() if token else None
        self.files = files  # those it was given in: rewritten without it once it is forgotten
        self._environ = environ

    @property
    def token(self) -> str | None:
        return self._token

    def __repr__(self) -> str:
        return f"HeldToken({'held' if self._token else 'none'})"

    def forget(self) -> list[str]:
        """Drop the token from this object, the environment and `files`; what could not be
        done, for the log (empty: nothing left that this process may change)."""
        token, self._token = self._token, None
        if not token:
            return []
        for variable in [v for v, value in self._environ.items() if token in value]:
            del self._environ[variable]  # os.environ: unsetenv too
        left = []
        for path in self.files:
            try:
                _drop_lines_with(path, token)
            except FileNotFoundError:
                continue  # nothing there holds it
            except OSError as exc:
                left.append(
                    f"{path} still holds the join token ({exc.strerror or exc}): remove it there "
                    "by hand; the agent no longer needs it"
                )
        return left


def forget_join_token(held: HeldToken) -> None:
    """`held.forget()`, saying in the log what it did and what it could not."""
    if held.token is None:
        return
    left = held.forget()
    for problem in left:
        log.warning("%s", problem)
    rewritten = [str(f) for f in held.files if not any(p.startswith(f"{f} ") for p in left)]
    also = f" and {', '.join(rewritten)}" if rewritten else ""
    log.info("this agent holds a credential of its own: its join token is forgotten (its "
             "settings, its environment%s)", also)  # fmt: skip


def _drop_lines_with(path: Path, secret: str) -> None:
    """Rewrite `path` in place (its mode and owner kept; also where it is a single file
    mounted writable, as a unit's ReadWritePaths= makes it) without the lines holding
    `secret`."""
    with path.open("r+") as handle:
        text = handle.read()
        if secret not in text:
            return
        kept = "".join(line for line in text.splitlines(keepends=True) if secret not in line)
        handle.seek(0)
        handle.write(kept)
        handle.truncate()
        handle.flush()
        os.fsync(handle.fileno())


class JoinFailed(Exception):
    """A join that cannot succeed as asked (refused, a CA that does not match the token);
    the message says why and what to do."""


class Unreachable(Exception):
    """The control plane did not answer: worth trying again."""


class Credential(BaseModel):
    """What an agent that joined keeps: its node, its credential, the fleet's CA, and its
    admin listener's certificate and key (PEM)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    node: str
    credential: str = Field(repr=False)
    ca: str
    cert: str
    key: str = Field(repr=False)

    def names(self) -> list[str]:
        """What its certificate names: the node's DNS name, then its addresses."""
        cert = x509.load_pem_x509_certificate(self.cert.encode())
        alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        ips = [str(ip) for ip in alt.get_values_for_type(x509.IPAddress)]
        return [*alt.get_values_for_type(x509.DNSName), *ips]

    def tls_files(self, state_dir: Path) -> TlsFiles:
        """The admin listener's certificate and key, written as files (0600) for it."""
        files = TlsFiles(state_dir / f"{ADMIN_TLS_STEM}.crt", state_dir / f"{ADMIN_TLS_STEM}.key")
        write_atomic(files.key, self.key)
        write_atomic(files.cert, self.cert)
        return files

    def ca_file(self, state_dir: Path) -> Path:
        """The fleet's CA certificate, written as a file for the engines' gates."""
        path = state_dir / FLEET_CA_FILE
        write_atomic(path, self.ca)
        return path


def load(state_dir: Path) -> Credential | None:
    """The credential kept in `state_dir`, or None when this agent has not joined. Raises
    JoinFailed when the file is there but unreadable."""
    path = state_dir / CREDENTIAL_FILE
    try:
        return Credential.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError) as exc:
        raise JoinFailed(
            f"{path} is unreadable ({exc}): restore it, or revoke the node and join it anew"
        ) from exc


def join(url: str, token: JoinToken, node: str, names: list[str], state_dir: Path) -> Credential:
    """Join the fleet whose agent API is at `url` as `node`, with a certificate for `names`
    for the admin listener; keep the credential in `state_dir`. Raises Unreachable (try again)
    or JoinFailed."""
    ca_pem = _fetch_ca(url, token)
    key_pem, csr_pem = request(names)
    body = JoinRequest(node=node, csr=csr_pem.decode()).model_dump_json()
    target = url.rstrip("/") + "/v1/join"
    for _ in range(2):  # a follower redirects the join to the leader, which keeps credentials
        try:
            answered = httpx.post(
                target,
                content=body,
                headers={"authorization": f"Bearer {token}", "content-type": "application/json"},
                verify=client_context(ca_pem),
                timeout=10,
            )
        except httpx.HTTPError as exc:
            raise Unreachable(f"cannot reach {target}: {type(exc).__name__}: {exc}") from exc
        if answered.status_code != 307 or "location" not in answered.headers:
            break
        target = answered.headers["location"]
    if answered.status_code == 503:  # no leader known yet, or it is stopping
        raise Unreachable(f"{target} cannot take a join now: {_error(answered)}")
    if answered.status_code != 200:
        raise JoinFailed(f"{url} refused the join ({answered.status_code}): {_error(answered)}")
    try:
        answer = JoinAnswer.model_validate_json(answered.content)
    except ValidationError as exc:
        raise JoinFailed(f"{url} answered the join with something unreadable: {exc}") from exc
    kept = Credential(
        node=answer.node,
        credential=answer.credential,
        ca=answer.ca,
        cert=answer.cert,
        key=key_pem.decode(),
    )
    write_atomic(state_dir / CREDENTIAL_FILE, kept.model_dump_json(indent=2))
    return kept


def join_until_answered(
    url: str,
    token: JoinToken,
    node: str,
    names: list[str],
    state_dir: Path,
    retry_every: float,
) -> Credential:
    """`join`, tried again every `retry_every` seconds while the control plane does not
    answer (it may not be up yet). Raises JoinFailed."""
    while True:
        try:
            return join(url, token, node, names, state_dir)
        except Unreachable as exc:
            log.warning("cannot join yet: %s; trying again in %.0fs", exc, retry_every)
            time.sleep(retry_every)


def _fetch_ca(url: str, token: JoinToken) -> bytes:
    """The fleet CA's certificate, accepted only if the token pins it. It is fetched over a
    connection not yet checked (there is nothing to check it against yet): the fingerprint is
    the check."""
    try:
        answered = httpx.get(url.rstrip("/") + "/v1/join/ca", verify=False, timeout=10)
    except httpx.HTTPError as exc:
        raise Unreachable(f"cannot reach {url}: {type(exc).__name__}: {exc}") from exc
    if answered.status_code != 200:
        raise JoinFailed(f"{url} gave no CA ({answered.status_code}): {_error(answered)}")
    try:
        pinned_ca(answered.content, token.ca_fingerprint)
    except PkiError as exc:
        raise JoinFailed(f"{url}: {exc}") from exc
    return answered.content


def _error(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"])
    except (ValueError, KeyError, TypeError):
        return response.text[:300]
