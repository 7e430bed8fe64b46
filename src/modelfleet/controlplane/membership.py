"""Who may report as which node: join tokens, and a credential per node.

An operator makes join tokens (`ctl join-tokens create`); an agent exchanges one, once, for a
credential of its node (`joining.py` says how the agent side goes). From then on the agent API
takes a report or heartbeat carrying a credential only for the node that credential was given
to. The store and this book keep SHA-256 digests, never a token's secret or a credential.
Every refusal is a `MembershipRefused` carrying the HTTP status to answer, and changes nothing.

A revoke is final for the tokens there were: a node name revoked (or deleted) at time T joins
again only with a join token made after T. A credential keeps the address its node joined
from, and that node may advertise no other for its engines (`address_refusal`): a node must
not steer the routers, and the prompts they carry, to a listener of its choosing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import hmac
import ipaddress
import re
from collections.abc import Collection, Iterable, Mapping

from modelfleet.messages import admin
from modelfleet.messages.wire import JoinAnswer, JoinRequest
from modelfleet.security.joining import BadJoinToken, JoinToken, digest, new_credential
from modelfleet.security.pki import CertificateAuthority, PkiError, read_request
from modelfleet.store import StoredCredential, StoredJoinToken
from modelfleet.store.calls import StoreCalls


class MembershipRefused(Exception):
    """A join, or a change of tokens or credentials, refused: what is wrong, and the status
    the API answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def token_state(token: StoredJoinToken, now: float) -> str:
    """ "usable", "expired" or "used up"."""
    if token.expires_at is not None and now >= token.expires_at:
        return "expired"
    if token.uses_left is not None and token.uses_left <= 0:
        return "used up"
    return "usable"


def token_info(token: StoredJoinToken, now: float) -> admin.JoinTokenInfo:
    return admin.JoinTokenInfo(
        id=token.id,
        created_at=token.created_at,
        expires_at=token.expires_at,
        uses_left=token.uses_left,
        used=token.used,
        state=token_state(token, now),
        addresses=list(token.addresses),
    )


def node_addresses(
    node: str,
    asked: Iterable[str],
    source: str,
    reserved: Collection[str],
    allowed: Collection[str] = (),
) -> list[str]:
    """The addresses node `node`'s certificate may name of those its request `asked` for: the
    one it joined from (`source`) and those its join token `allowed`, unless a control plane
    or router is reached there (`reserved`: its certificate would pass for theirs). Any other
    address is left out (the node is still reached, and checked, by its name); a host name or
    a wildcard asked for is refused (MembershipRefused 400): nothing but an attempt on
    another's name asks for one."""
    its_own = {_address(source), *map(_address, allowed)} - {None}
    theirs = {_address(r) for r in reserved}
    kept = []
    for name in asked:
        address = _address(name)
        if address is None:
            raise MembershipRefused(
                400,
                f"csr: node {node} asks for a certificate naming {name!r}; a node's certificate "
                "names the node and the address it joins from, never a host name or a wildcard",
            )
        if address in its_own and address not in theirs:
            kept.append(str(address))
    return kept


def token_addresses(given: Iterable[str]) -> tuple[str, ...]:
    """The addresses an operator lets a node joining with a token advertise, written as the
    control plane compares them; MembershipRefused 400 naming one that is no IP address, or
    loopback or unspecified (loopback only a node that joins over loopback may advertise)."""
    kept: list[str] = []
    for text in given:
        address = _address(text)
        if (
            address is None
            or address.is_loopback
            or not re.fullmatch(admin.TOKEN_ADDRESS_PATTERN, text)
        ):
            raise MembershipRefused(
                400,
                f"addresses: {text!r} is no address a join token may allow: give IPv4 addresses "
                "of the node's own, written plainly (loopback only a node that joins over "
                "loopback advertises; IPv6 ones are not taken yet)",
            )
        if str(address) not in kept:
            kept.append(str(address))
    return tuple(kept)


def address_refusal(node: str, advertised: str, joined_from: Collection[str] | None) -> str | None:
    """Why node `node`, which joined from the addresses `joined_from` (the one its join came
    from, and those its join token allowed; None: not known, a credential older than that
    record), may not advertise `advertised` for its engines; None when it may. It may
    advertise those alone, and loopback only when it joined over loopback (then any loopback
    address: it shares the control plane's host)."""
    if joined_from is None:
        return None
    address = _address(advertised)
    allowed = {a for a in map(_address, joined_from) if a is not None}
    if address is not None and (
        address in allowed or (address.is_loopback and any(a.is_loopback for a in allowed))
    ):
        return None
    where = ", ".join(joined_from) or "nothing"
    return (
        f"node {node} advertises {advertised!r} for its engines, but may advertise only {where} "
        "(the address it joined from, and those its join token allows; loopback only after a "
        "loopback join). Run its agent with --address set to one of them, or revoke it and "
        "join it anew (`ctl join-tokens create --address ADDRESS` allows another)"
    )


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`text` as an address (an IPv4 address mapped into IPv6 as itself); None when it is no
    address, or the unspecified one."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return None if address.is_unspecified else address


class Membership:
    """The join tokens and node credentials: the store's, with a copy in memory, so that the
    check on every report and heartbeat is a dictionary lookup."""

    def __init__(
        self,
        calls: StoreCalls,
        ca: CertificateAuthority | None,
        tokens: Iterable[StoredJoinToken] = (),
        credentials: Iterable[StoredCredential] = (),
        revoked: Mapping[str, float] | None = None,
    ) -> None:
        self.calls = calls
        self.store = calls.store
        self.ca = ca  # None: joins are refused (a control plane made without its CA, in tests)
        self.tokens = {t.id: t for t in tokens}
        self.credentials = {c.node: c for c in credentials}
        self._nodes = {c.sha256: c.node for c in self.credentials.values()}
        # Node names revoked or deleted, and when last (wall-clock seconds, the store's): a
        # token made then or before joins none of them again.
        self.revoked = dict(revoked or {})
        # Credentials revoked since this control plane started (digest -> node): a refusal
        # can then say so. Those revoked before are refused as unknown.
        self._revoked: dict[str, str] = {}
        # One change at a time: each checks what the last made (a token's uses, a name).
        self.writing = asyncio.Lock()

    async def create_token(
        self, ttl: float | None, uses: int | None, now: float, addresses: Iterable[str] = ()
    ) -> tuple[JoinToken, StoredJoinToken]:
        """A new join token (shown once) and what is stored of it; `addresses`: those a node
        joining with it may advertise besides its own (`token_addresses`)."""
        allowed = token_addresses(addresses)
        async with self.writing:
            return await self._create_token(ttl, uses, now, allowed)

    async def revoke_token(self, token_id: str) -> StoredJoinToken:
        """Delete a join token: nobody joins with it after this (nodes that joined stay)."""
        async with self.writing:
            return await self._revoke_token(token_id)

    async def join(
        self,
        presented: str,
        request: JoinRequest,
        now: float,
        source: str,
        reserved: Collection[str] = (),
    ) -> JoinAnswer:
        """Exchange a join token for a new credential of `request.node`, and sign its
        listeners' certificate request (`node_addresses` says what it names), the join having
        come from address `source`; `reserved`: the hosts a control plane or router is reached
        by."""
        async with self.writing:
            return await self._join(presented, request, now, source, reserved)

    async def revoke_node(self, node: str, now: float) -> None:
        """Delete `node`'s credential (MembershipRefused 404 when it holds none): nothing it
        sends is taken after this, and no join token made before `now` joins it again."""
        async with self.writing:
            if node not in self.credentials:
                raise MembershipRefused(404, f"node {node} holds no credential")
            await self._cut_off(node, now)

    async def cut_off(self, node: str, now: float) -> None:
        """No join token made before `now` joins `node` again, and a credential it holds is
        deleted (a node forgotten by an operator)."""
        async with self.writing:
            await self._cut_off(node, now)

    async def _create_token(
        self, ttl: float | None, uses: int | None, now: float, addresses: tuple[str, ...]
    ) -> tuple[JoinToken, StoredJoinToken]:
        if self.ca is None:
            raise MembershipRefused(503, "this control plane has no CA to pin in a join token")
        token = JoinToken.new(self.ca.fingerprint)
        stored = StoredJoinToken(
            id=token.id,
            sha256=digest(token.secret),
            created_at=now,
            expires_at=None if ttl is None else now + ttl,
            uses_left=uses,
            addresses=addresses,
        )
        await self.calls(self.store.put_join_token, stored)
        self.tokens[stored.id] = stored
        return token, stored

    async def _revoke_token(self, token_id: str) -> StoredJoinToken:
        token = self.tokens.get(token_id)
        if token is None:
            known = ", ".join(self.tokens) or "there are none"
            raise MembershipRefused(404, f"no join token {token_id!r} (tokens: {known})")
        await self.calls(self.store.delete_join_token, token_id)
        del self.tokens[token_id]
        return token

    def usable_token(self, presented: str, now: float) -> tuple[JoinToken, StoredJoinToken]:
        """The join token `presented` and what is stored of it, when it is one a node may
        join with now; MembershipRefused (401 when it is not, 503 with no CA) otherwise."""
        if self.ca is None:
            raise MembershipRefused(503, "this control plane has no CA: it takes no joins")
        try:
            token = JoinToken.parse(presented)
        except BadJoinToken as exc:
            raise MembershipRefused(401, str(exc)) from None
        stored = self.tokens.get(token.id)
        if stored is None or not hmac.compare_digest(stored.sha256, digest(token.secret)):
            raise MembershipRefused(401, "unknown or revoked join token")
        state = token_state(stored, now)
        if state != "usable":
            raise MembershipRefused(401, f"join token {token.id} is {state}: make another")
        return token, stored

    async def _join(
        self,
        presented: str,
        request: JoinRequest,
        now: float,
        source: str,
        reserved: Collection[str],
    ) -> JoinAnswer:
        token, stored = self.usable_token(presented, now)
        ca = self.ca
        assert ca is not None  # usable_token refused the join otherwise
        node = request.node
        cut = self.revoked.get(node)
        if cut is not None and stored.created_at <= cut:
            raise MembershipRefused(
                403,
                f"node {node} was revoked or deleted after join token {token.id} was made: no "
                "token made before that brings it back. To put a machine back under this "
                "name, make a new join token and run its agent with it",
            )
        if node in self.credentials:
            raise MembershipRefused(
                409,
                f"node {node} has joined already; to join it again (a machine set up anew), "
                f"revoke it first (`modelfleet ctl nodes revoke {node}`), or pick another name",
            )
        try:
            asked = read_request(request.csr.encode())
        except PkiError as exc:
            raise MembershipRefused(400, f"csr: {exc}") from None
        addresses = node_addresses(node, asked.names, source, reserved, stored.addresses)
        when = datetime.datetime.fromtimestamp(now, datetime.UTC)
        cert = ca.sign_node(asked, node, addresses, when)
        credential = new_credential()
        uses_left = None if stored.uses_left is None else stored.uses_left - 1
        used = dataclasses.replace(stored, uses_left=uses_left, used=stored.used + 1)
        joined_from = str(_address(source) or source)
        may_advertise = tuple(dict.fromkeys([joined_from, *stored.addresses]))
        record = StoredCredential(node, digest(credential), now, stored.id, may_advertise)
        await self.calls(self.store.record_join, used, record)
        self.tokens[used.id] = used
        self.credentials[node] = record
        self._nodes[record.sha256] = node
        return JoinAnswer(
            node=node, credential=credential, ca=ca.cert_pem.decode(), cert=cert.decode()
        )

    def node_of(self, credential: str) -> str | None:
        """The node `credential` was given to; None if it is nobody's (or was revoked)."""
        return self._nodes.get(digest(credential))

    def revoked_node(self, credential: str) -> str | None:
        """The node `credential` was given to, if it was revoked since this control plane
        started."""
        return self._revoked.get(digest(credential))

    def has_joined(self, node: str) -> bool:
        return node in self.credentials

    def address_refusal(self, node: str, advertised: str) -> str | None:
        """Why `node`, holding a credential, may not advertise `advertised`; None if it may."""
        record = self.credentials.get(node)
        return None if record is None else address_refusal(node, advertised, record.addresses)

    async def _cut_off(self, node: str, now: float) -> None:
        await self.calls(self.store.revoke_node, node, now)
        self.revoked[node] = now
        record = self.credentials.pop(node, None)
        if record is not None:
            del self._nodes[record.sha256]
            self._revoked[record.sha256] = node
