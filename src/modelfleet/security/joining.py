"""Join tokens and node credentials: how an agent on another machine joins the fleet.

An operator makes a join token (`ctl join-tokens create`) and gives it to a new machine's
agent (`agent --join URL --token TOKEN --node NAME`). The token carries the fleet CA's
fingerprint, as kubeadm's discovery hash does: the agent fetches the CA's certificate from the
control plane, refuses it unless its fingerprint is the token's, and from then on trusts that
CA alone. It then exchanges the token, once, for a credential of its own node, which it keeps
(0600) and uses for every report and heartbeat after. The control plane keeps only hashes of
both, and knows which credential is which node's.

A token reads `mfjoin.<id>.<secret>.<CA fingerprint hex>`; a credential `mfnode.<secret>`.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

JOIN_PREFIX = "mfjoin"
CREDENTIAL_PREFIX = "mfnode."
_TOKEN = re.compile(r"^mfjoin\.([0-9a-f]{12})\.([0-9a-f]{32})\.([0-9a-f]{64})$")


class BadJoinToken(ValueError):
    """Text that is no join token; the message says what a token looks like."""


@dataclass(frozen=True)
class JoinToken:
    """A join token: its public id, its secret, and the fingerprint of the CA it pins."""

    id: str
    secret: str
    ca_fingerprint: str  # "sha256:<hex>", as `pki.fingerprint` writes it

    @classmethod
    def new(cls, ca_fingerprint: str) -> JoinToken:
        return cls(secrets.token_hex(6), secrets.token_hex(16), ca_fingerprint)

    @classmethod
    def parse(cls, text: str) -> JoinToken:
        found = _TOKEN.match(text.strip())
        if found is None:
            raise BadJoinToken(
                "not a join token: one reads mfjoin.<12 hex>.<32 hex>.<64 hex>, as "
                "`modelfleet ctl join-tokens create` prints it"
            )
        token_id, secret, ca = found.groups()
        return cls(token_id, secret, "sha256:" + ca)

    def __str__(self) -> str:
        ca = self.ca_fingerprint.removeprefix("sha256:")
        return f"{JOIN_PREFIX}.{self.id}.{self.secret}.{ca}"


def is_join_token(text: str) -> bool:
    """Whether `text` is meant as a join token (it may still be malformed)."""
    return text.startswith(JOIN_PREFIX + ".")


def new_credential() -> str:
    """A node's credential: the prefix and 256 random bits."""
    return CREDENTIAL_PREFIX + secrets.token_urlsafe(32)


def digest(secret: str) -> str:
    """The form in which a token's secret or a credential is kept and looked up."""
    return hashlib.sha256(secret.encode()).hexdigest()
