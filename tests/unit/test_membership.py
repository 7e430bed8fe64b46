"""Join tokens and node credentials (`controlplane/membership.py`, `joining.py`)."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from hypothesis import given
from hypothesis import strategies as st

from modelfleet.controlplane.membership import Membership, MembershipRefused, token_state
from modelfleet.joining import BadJoinToken, JoinToken, digest
from modelfleet.pki import CertificateAuthority, PkiError, request
from modelfleet.store.calls import StoreCalls
from modelfleet.store.sqlite import SqliteStore
from modelfleet.wire import JoinRequest

from .awaited import Awaited

NOW = 1_800_000_000.0


def book_of(store: SqliteStore, ca: CertificateAuthority | None) -> Any:
    """A book on `store` as a control plane reads it, its changes run to their end."""
    calls = StoreCalls(store, 5.0)
    return Awaited(Membership(calls, ca, store.join_tokens(), store.credentials()))


CA = CertificateAuthority.create("test CA", datetime.datetime.fromtimestamp(NOW, datetime.UTC))


def join_request(node: str, names: tuple[str, ...] = ("10.0.0.7",)) -> JoinRequest:
    _, csr = request(list(names))
    return JoinRequest(node=node, csr=csr.decode())


def refused(status: int, call: object) -> str:
    assert callable(call)
    with pytest.raises(MembershipRefused) as caught:
        call()
    assert caught.value.status == status, caught.value
    return str(caught.value)


@given(st.binary(min_size=6, max_size=6), st.binary(min_size=16, max_size=16))
def test_a_token_reads_back_as_it_was_written(ident: bytes, secret: bytes) -> None:
    token = JoinToken(ident.hex(), secret.hex(), CA.fingerprint)
    assert JoinToken.parse(str(token)) == token
    assert JoinToken.parse(f"  {token}\n") == token  # pasted with the line around it


@pytest.mark.parametrize(
    "text",
    ["", "mfjoin.abc", "mfnode.xyz", "mfjoin.0123456789ab.nothex.", "mfjoin." + "0" * 120],
)
def test_text_that_is_no_token_says_what_a_token_looks_like(text: str) -> None:
    with pytest.raises(BadJoinToken, match=r"mfjoin\.<12 hex>"):
        JoinToken.parse(text)


def test_a_join_gives_a_credential_for_that_node_alone_and_a_certificate_of_the_ca(
    tmp_path: Path,
) -> None:
    book = book_of(SqliteStore(tmp_path / "store.sqlite"), CA)
    token, stored = book.create_token(3600, 2, NOW)
    assert token.ca_fingerprint == CA.fingerprint and stored.sha256 == digest(token.secret)
    assert token.secret not in repr(stored)

    answer = book.join(str(token), join_request("b"), NOW + 1)
    assert answer.node == "b" and answer.ca == CA.cert_pem.decode()
    assert book.node_of(answer.credential) == "b"
    assert book.node_of(answer.credential + "x") is None
    cert = x509.load_pem_x509_certificate(answer.cert.encode())
    cert.verify_directly_issued_by(CA.cert)
    alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in alt.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    assert book.tokens[token.id].uses_left == 1 and book.tokens[token.id].used == 1

    # The store keeps hashes only, and a control plane started again knows the same.
    again = book_of(SqliteStore(tmp_path / "store.sqlite"), CA)
    assert again.node_of(answer.credential) == "b"
    assert again.tokens[token.id].uses_left == 1
    raw = (tmp_path / "store.sqlite").read_bytes()
    assert answer.credential.encode() not in raw and token.secret.encode() not in raw


def test_every_refused_join_says_why_and_changes_nothing() -> None:
    book = book_of(SqliteStore(":memory:"), CA)
    token, _ = book.create_token(60, 1, NOW)
    wrong_secret = str(JoinToken(token.id, "0" * 32, token.ca_fingerprint))
    assert "unknown or revoked" in refused(
        401, lambda: book.join(wrong_secret, join_request("b"), NOW)
    )
    assert "not a join token" in refused(401, lambda: book.join("mfnode.x", join_request("b"), NOW))
    bad_csr = JoinRequest(node="b", csr="-----BEGIN CERTIFICATE REQUEST-----\nnope")
    assert "csr:" in refused(400, lambda: book.join(str(token), bad_csr, NOW))
    expired = refused(401, lambda: book.join(str(token), join_request("b"), NOW + 60))
    assert "is expired" in expired
    assert book.tokens[token.id].uses_left == 1 and not book.credentials  # none of it counted

    answer = book.join(str(token), join_request("b"), NOW)
    other, _ = book.create_token(None, None, NOW)
    assert "used up" in refused(401, lambda: book.join(str(token), join_request("c"), NOW))
    # A node that joined cannot be claimed again by whoever holds another token.
    assert "has joined already" in refused(
        409, lambda: book.join(str(other), join_request("b"), NOW)
    )
    assert book.node_of(answer.credential) == "b"


def test_a_revoked_credential_is_nobodys_and_its_node_may_join_anew() -> None:
    book = book_of(SqliteStore(":memory:"), CA)
    token, _ = book.create_token(None, None, NOW)
    first = book.join(str(token), join_request("b"), NOW)
    book.revoke_node("b")
    assert book.node_of(first.credential) is None and not book.has_joined("b")
    assert "holds no credential" in refused(404, lambda: book.revoke_node("b"))
    second = book.join(str(token), join_request("b"), NOW)
    assert book.node_of(second.credential) == "b" and second.credential != first.credential


def test_a_revoked_token_is_refused_and_the_token_states() -> None:
    book = book_of(SqliteStore(":memory:"), CA)
    token, stored = book.create_token(10, None, NOW)
    assert token_state(stored, NOW) == "usable" and token_state(stored, NOW + 10) == "expired"
    book.revoke_token(token.id)
    assert "unknown or revoked" in refused(
        401, lambda: book.join(str(token), join_request("b"), NOW)
    )
    assert "no join token" in refused(404, lambda: book.revoke_token(token.id))


def test_a_control_plane_without_a_ca_makes_no_tokens_and_takes_no_joins() -> None:
    book = book_of(SqliteStore(":memory:"), None)
    refused(503, lambda: book.create_token(60, None, NOW))
    token = JoinToken.new(CA.fingerprint)
    refused(503, lambda: book.join(str(token), join_request("b"), NOW))


def test_a_certificate_request_is_signed_only_as_it_was_made() -> None:
    _, csr = request(["node-b.example", "10.0.0.7"])
    signed = x509.load_pem_x509_certificate(CA.sign(csr, datetime.datetime.now(datetime.UTC)))
    alt = signed.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert alt.get_values_for_type(x509.DNSName) == ["node-b.example"]
    # Another key's signature over the same request: refused.
    _, other = request(["node-b.example", "10.0.0.7"])
    tampered = csr[: csr.index(b"-----END")][:-40] + other[other.index(b"-----END") - 40 :]
    with pytest.raises(PkiError):
        CA.sign(tampered, datetime.datetime.now(datetime.UTC))
    with pytest.raises(PkiError, match="1 to 16 hosts"):
        request([])
