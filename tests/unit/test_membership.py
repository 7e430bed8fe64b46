"""Join tokens and node credentials (`controlplane/membership.py`, `joining.py`)."""

from __future__ import annotations

import datetime
import ssl
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from hypothesis import given
from hypothesis import strategies as st

from modelfleet.controlplane.membership import (
    Membership,
    MembershipRefused,
    address_refusal,
    token_state,
)
from modelfleet.messages.wire import JoinRequest
from modelfleet.security.joining import BadJoinToken, JoinToken, digest
from modelfleet.security.pki import (
    CertificateAuthority,
    PkiError,
    TlsFiles,
    client_context,
    node_host,
    read_request,
    request,
    server_context,
)
from modelfleet.store.calls import StoreCalls
from modelfleet.store.sqlite import SqliteStore

from .awaited import Awaited

NOW = 1_800_000_000.0
SOURCE = "10.0.0.7"  # where the joins come from


def book_of(store: SqliteStore, ca: CertificateAuthority | None) -> Any:
    """A book on `store` as a control plane reads it, its changes run to their end."""
    calls = StoreCalls(store, 5.0)
    return Awaited(
        Membership(calls, ca, store.join_tokens(), store.credentials(), store.revoked_nodes())
    )


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

    answer = book.join(str(token), join_request("b"), NOW + 1, SOURCE)
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
        401, lambda: book.join(wrong_secret, join_request("b"), NOW, SOURCE)
    )
    assert "not a join token" in refused(
        401, lambda: book.join("mfnode.x", join_request("b"), NOW, SOURCE)
    )
    bad_csr = JoinRequest(node="b", csr="-----BEGIN CERTIFICATE REQUEST-----\nnope")
    assert "csr:" in refused(400, lambda: book.join(str(token), bad_csr, NOW, SOURCE))
    expired = refused(401, lambda: book.join(str(token), join_request("b"), NOW + 60, SOURCE))
    assert "is expired" in expired
    assert book.tokens[token.id].uses_left == 1 and not book.credentials  # none of it counted

    answer = book.join(str(token), join_request("b"), NOW, SOURCE)
    other, _ = book.create_token(None, None, NOW)
    assert "used up" in refused(401, lambda: book.join(str(token), join_request("c"), NOW, SOURCE))
    # A node that joined cannot be claimed again by whoever holds another token.
    assert "has joined already" in refused(
        409, lambda: book.join(str(other), join_request("b"), NOW, SOURCE)
    )
    assert book.node_of(answer.credential) == "b"


def test_a_revoked_node_joins_anew_only_with_a_token_made_after_the_revoke(
    tmp_path: Path,
) -> None:
    """Issue (members): a revoked node joined again at once with the token it was started
    with (any number of uses). Now no token made before the revoke brings it back, also
    after a restart of the control plane; a new token does."""
    store = SqliteStore(tmp_path / "store.sqlite")
    book = book_of(store, CA)
    token, _ = book.create_token(None, None, NOW)
    first = book.join(str(token), join_request("b"), NOW, SOURCE)
    book.revoke_node("b", NOW + 1)
    assert book.node_of(first.credential) is None and not book.has_joined("b")
    assert "holds no credential" in refused(404, lambda: book.revoke_node("b", NOW + 2))
    for again in (book, book_of(store, CA)):  # and as a control plane started anew reads it
        said = refused(403, partial(again.join, str(token), join_request("b"), NOW + 3, SOURCE))
        assert "node b was revoked or deleted after join token" in said
    book.join(str(token), join_request("c"), NOW + 3, SOURCE)  # other names still join with it
    later, _ = book.create_token(None, 1, NOW + 4)
    second = book.join(str(later), join_request("b"), NOW + 5, SOURCE)
    assert book.node_of(second.credential) == "b" and second.credential != first.credential


def test_a_deleted_name_is_cut_off_like_a_revoked_one() -> None:
    book = book_of(SqliteStore(":memory:"), CA)
    token, _ = book.create_token(None, None, NOW)
    joined = book.join(str(token), join_request("b"), NOW, SOURCE)
    book.cut_off("b", NOW + 1)  # `ctl nodes delete b`
    book.cut_off("never-joined", NOW + 1)
    assert book.node_of(joined.credential) is None
    for node in ("b", "never-joined"):
        refused(403, partial(book.join, str(token), join_request(node), NOW + 2, SOURCE))


@pytest.mark.parametrize(
    ("joined_from", "advertised", "taken"),
    [
        (("10.0.0.7",), "10.0.0.7", True),
        (("10.0.0.7",), "127.0.0.1", False),  # the router's own loopback, from another host
        (("10.0.0.7",), "10.0.0.8", False),
        (("10.0.0.7",), "gpu-1.example", False),  # a name resolves to whatever its DNS says
        (("10.0.0.7",), "::ffff:10.0.0.7", True),
        (("127.0.0.1",), "127.0.0.1", True),
        (("127.0.0.1",), "::1", True),  # a loopback join: the control plane's own host
        (("127.0.0.1",), "10.0.0.7", False),
        (None, "127.0.0.1", True),  # a credential older than the record: not checked
    ],
)
def test_a_node_advertises_only_the_address_it_joined_from(
    joined_from: tuple[str, ...] | None, advertised: str, taken: bool
) -> None:
    why = address_refusal("b", advertised, joined_from)
    assert (why is None) == taken, why
    if not taken:
        assert f"node b advertises {advertised!r}" in str(why) and "--address" in str(why)


def test_a_token_may_allow_addresses_besides_the_one_a_node_joins_from() -> None:
    """The operator's part of the rule: `ctl join-tokens create --address A` lets a node
    joining with it advertise A (and have its certificate name it) besides its own."""
    book = book_of(SqliteStore(":memory:"), CA)
    for wrong in ("127.0.0.1", "::1", "0.0.0.0", "gpu-1.example", "::ffff:10.0.1.7", "010.0.1.7"):
        said = refused(400, partial(book.create_token, None, 1, NOW, [wrong]))
        assert f"addresses: {wrong!r} is no address a join token may allow" in said
    token, stored = book.create_token(None, 1, NOW, ["10.0.1.7", "10.0.1.7", "10.0.1.8"])
    assert stored.addresses == ("10.0.1.7", "10.0.1.8")
    answer = book.join(str(token), join_request("b", ("10.0.0.7", "10.0.1.7", "10.0.2.9")), NOW,
                       SOURCE)  # fmt: skip
    cert = x509.load_pem_x509_certificate(answer.cert.encode())
    alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in alt.get_values_for_type(x509.IPAddress)] == ["10.0.0.7", "10.0.1.7"]
    assert book.credentials["b"].addresses == ("10.0.0.7", "10.0.1.7", "10.0.1.8")
    for advertised in ("10.0.0.7", "10.0.1.7", "10.0.1.8"):
        assert book.address_refusal("b", advertised) is None
    assert "may advertise only 10.0.0.7, 10.0.1.7, 10.0.1.8 " in str(
        book.address_refusal("b", "10.0.2.9")
    )


def test_a_credential_keeps_the_address_its_node_joined_from() -> None:
    book = book_of(SqliteStore(":memory:"), CA)
    token, _ = book.create_token(None, None, NOW)
    book.join(str(token), join_request("b"), NOW, "::ffff:10.0.0.7")
    assert book.credentials["b"].addresses == ("10.0.0.7",)
    assert book.address_refusal("b", "10.0.0.7") is None
    assert book.address_refusal("b", "127.0.0.1") is not None
    assert book.address_refusal("not-joined", "127.0.0.1") is None


def test_a_revoked_token_is_refused_and_the_token_states() -> None:
    book = book_of(SqliteStore(":memory:"), CA)
    token, stored = book.create_token(10, None, NOW)
    assert token_state(stored, NOW) == "usable" and token_state(stored, NOW + 10) == "expired"
    book.revoke_token(token.id)
    assert "unknown or revoked" in refused(
        401, lambda: book.join(str(token), join_request("b"), NOW, SOURCE)
    )
    assert "no join token" in refused(404, lambda: book.revoke_token(token.id))


def test_a_control_plane_without_a_ca_makes_no_tokens_and_takes_no_joins() -> None:
    book = book_of(SqliteStore(":memory:"), None)
    refused(503, lambda: book.create_token(60, None, NOW))
    token = JoinToken.new(CA.fingerprint)
    refused(503, lambda: book.join(str(token), join_request("b"), NOW, SOURCE))


def names_in(answer: Any) -> tuple[list[str], list[str], list[str]]:
    """The DNS names, IP addresses and URIs a join's certificate names."""
    cert = x509.load_pem_x509_certificate(answer.cert.encode())
    cert.verify_directly_issued_by(CA.cert)
    alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return (
        alt.get_values_for_type(x509.DNSName),
        [str(ip) for ip in alt.get_values_for_type(x509.IPAddress)],
        alt.get_values_for_type(x509.UniformResourceIdentifier),
    )


def test_a_node_certificate_names_the_node_and_only_the_address_it_joined_from() -> None:
    """Issue 39: a join token bought a certificate for whatever names its request asked for,
    the control plane's own address among them, and ctl then sent the admin token to an
    impostor. A node's certificate names the node, and of the addresses asked for only the
    one it joined from, unless a control plane or router is reached there."""
    book = book_of(SqliteStore(":memory:"), CA)
    token, _ = book.create_token(None, None, NOW)
    answer = book.join(str(token), join_request("b", ("10.0.0.7", "10.0.0.1")), NOW, SOURCE)
    assert names_in(answer) == (
        ["b.node.modelfleet.invalid"],
        ["10.0.0.7"],  # 10.0.0.1 (another machine's) left out
        ["spiffe://modelfleet/node/b"],
    )
    # Joined from where a control plane is reached: the node's name only.
    shared_host = book.join(
        str(token), join_request("c", (SOURCE,)), NOW, SOURCE, reserved={"10.0.0.7", "cp.lan"}
    )
    assert names_in(shared_host)[1] == []
    # Over IPv6, an IPv4 client is seen as a mapped address: the same address.
    mapped = book.join(str(token), join_request("d"), NOW, "::ffff:10.0.0.7")
    assert names_in(mapped)[1] == ["10.0.0.7"]
    for asked in ("cp.lan", "*.lan", "0.0.0.0"):
        bad = join_request("e", (asked,))
        why = refused(400, lambda bad=bad: book.join(str(token), bad, NOW, SOURCE))
        assert f"naming {asked!r}" in why and "never a host name" in why
    assert not book.has_joined("e")


def test_node_names_map_to_distinct_dns_names() -> None:
    assert node_host("gpu-7") == "gpu-7.node.modelfleet.invalid"
    assert node_host("GPU-7") != node_host("gpu-7")  # names differ by case: never one host
    long = "N" + "x" * 62
    assert all(len(label) <= 63 for label in node_host(long).split("."))
    assert len({node_host(n) for n in ("a--b", "x--61", "a", "A", "a.b", "a_b")}) == 6


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext, host: str) -> None:
    """A TLS handshake in memory, the client checking that the server is `host`."""
    pipes = [ssl.MemoryBIO() for _ in range(4)]  # client->server, server->client, twice
    c = client.wrap_bio(pipes[0], pipes[1], server_hostname=host)
    s = server.wrap_bio(pipes[2], pipes[3], server_side=True)
    done = [False, False]
    for _ in range(20):
        for i, side in enumerate((c, s)):
            if not done[i]:
                try:
                    side.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
        pipes[2].write(pipes[1].read())  # what the client sent reaches the server
        pipes[0].write(pipes[3].read())
        if all(done):
            return
    raise AssertionError("the handshake never finished")


@pytest.mark.parametrize("other", ["GPU-7", "Gpu-7", "gPU-7"])
def test_a_node_named_like_another_but_for_case_is_never_taken_for_it(
    other: str, tmp_path: Path
) -> None:
    """M34: DNS compares names case-insensitively, and so does TLS's check of a server's
    name: a node named like another but for case must never have a certificate that passes
    for the other's (its name is written as hex, `node_host`), or a node could answer as
    another. Compared by case, the two names only looked different."""
    assert node_host(other).lower() != node_host("gpu-7").lower()
    now = datetime.datetime.now(datetime.UTC)
    ca = CertificateAuthority.create("test CA", now)
    key, csr = request(["10.0.0.7"])
    cert = ca.sign_node(read_request(csr), other, [], now)
    (tmp_path / "cert.pem").write_bytes(cert + ca.cert_pem)
    (tmp_path / "key.pem").write_bytes(key)
    server = server_context(TlsFiles(tmp_path / "cert.pem", tmp_path / "key.pem"))
    _handshake(server, client_context(ca.cert_pem), node_host(other))  # its own name: passes
    with pytest.raises(ssl.SSLCertVerificationError, match="mismatch"):
        _handshake(server, client_context(ca.cert_pem), node_host("gpu-7"))


def test_a_certificate_request_must_be_signed_by_its_own_key() -> None:
    _, csr = request(["10.0.0.7"])
    assert read_request(csr).names == ("10.0.0.7",)
    # Another key's signature over the same request: refused.
    _, other = request(["10.0.0.7"])
    tampered = csr[: csr.index(b"-----END")][:-40] + other[other.index(b"-----END") - 40 :]
    with pytest.raises(PkiError):
        read_request(tampered)
    with pytest.raises(PkiError, match="1 to 16 hosts"):
        request([])
