"""The fleet's CA (`pki.py`) and the listeners that serve TLS with what it issues: made once
and kept, private keys readable by their owner only, every client verifying the server
against the CA it was given, and plain HTTP refused on a TLS listener."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import signal
import stat
import time
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from modelfleet.http.serving import Listener, run_service
from modelfleet.security.pki import (
    CA_CERT,
    CA_KEY,
    CertificateAuthority,
    PkiError,
    client_context,
    fingerprint,
    pinned_ca,
)

NOW = datetime.datetime(2026, 12, 4, 12, 0, tzinfo=datetime.UTC)


def test_the_ca_is_made_once_kept_private_and_never_made_again_over_half_of_it(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "pki"
    made = CertificateAuthority.load_or_create(folder, "fleet", NOW)
    kept = CertificateAuthority.load_or_create(folder, "fleet", NOW)
    assert kept.fingerprint == made.fingerprint and made.fingerprint.startswith("sha256:")
    assert stat.S_IMODE((folder / CA_KEY).stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    cert = x509.load_pem_x509_certificate((folder / CA_CERT).read_bytes())
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert constraints.ca and cert.not_valid_after_utc > NOW + datetime.timedelta(days=3000)

    (folder / CA_KEY).unlink()
    with pytest.raises(PkiError, match=r"ca\.key is not"):
        CertificateAuthority.load_or_create(folder, "fleet", NOW)
    assert (folder / CA_CERT).read_bytes() == made.cert_pem  # nothing was made over it


def test_a_ca_is_pinned_by_its_fingerprint_and_another_is_refused() -> None:
    ours = CertificateAuthority.create("fleet", NOW)
    theirs = CertificateAuthority.create("fleet", NOW)  # the same name, another key
    assert fingerprint(pinned_ca(ours.cert_pem, ours.fingerprint)) == ours.fingerprint
    with pytest.raises(PkiError, match="not the sha256:"):
        pinned_ca(theirs.cert_pem, ours.fingerprint)


def test_an_issued_certificate_names_where_its_server_is_reached(tmp_path: Path) -> None:
    ca = CertificateAuthority.create("fleet", NOW)
    files = ca.issue(["cp.fleet.internal", "10.0.0.1"], NOW, days=30).write(tmp_path, "cp")
    assert stat.S_IMODE(files.key.stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["cp.fleet.internal"]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.1"]
    assert cert.issuer == ca.cert.subject
    assert cert.not_valid_after_utc == NOW + datetime.timedelta(days=30)
    with pytest.raises(PkiError, match="at least one name"):
        ca.issue([], NOW)


async def _scheme(request: Request) -> PlainTextResponse:
    return PlainTextResponse(request.url.scheme)


APP = Starlette(routes=[Route("/scheme", _scheme)])


def test_listeners_given_a_certificate_serve_tls_only_and_clients_verify_it(
    tmp_path: Path,
) -> None:
    """A service's listener serves TLS with a certificate of the fleet's CA: a client that
    trusts the CA gets its answer; one that trusts another CA, or reaches a server by a name
    its certificate does not hold, is refused; plain HTTP gets no answer."""
    now = datetime.datetime.now(datetime.UTC)
    ca = CertificateAuthority.load_or_create(tmp_path / "pki", "fleet", now)
    ours = ca.issue(["127.0.0.1"], now).write(tmp_path / "tls", "ours")
    misnamed = ca.issue(["elsewhere.example"], now).write(tmp_path / "tls", "misnamed")
    other = CertificateAuthority.create("another fleet", now)

    async def test() -> None:
        listeners = [
            Listener("lean", APP, tls=ours),
            Listener("misnamed", APP, tls=misnamed),
        ]
        ready = tmp_path / "ready.json"
        service = asyncio.ensure_future(run_service(listeners, ready_file=ready))
        deadline = time.monotonic() + 10
        while not ready.exists():
            assert time.monotonic() < deadline, "the service did not write its ready file"
            assert not service.done(), "the service stopped while starting"
            await asyncio.sleep(0.02)
        urls = json.loads(ready.read_text())["urls"]
        try:
            trusting = httpx.AsyncClient(verify=client_context(ca.cert_pem))
            strangers = httpx.AsyncClient(verify=client_context(other.cert_pem))
            plain = httpx.AsyncClient()
            async with trusting, strangers, plain:
                for name in ("lean",):
                    url = urls[name]
                    assert url.startswith("https://127.0.0.1:"), url
                    answer = await trusting.get(url + "/scheme")
                    assert (answer.status_code, answer.text) == (200, "https"), name
                    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                        await strangers.get(url + "/scheme")
                    with pytest.raises(httpx.TransportError):
                        await plain.get(url.replace("https://", "http://") + "/scheme")
                with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                    await trusting.get(urls["misnamed"] + "/scheme")
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(service, 10)

    asyncio.run(test())


def test_the_control_plane_serves_plain_http_on_loopback_only() -> None:
    from pydantic import ValidationError

    from modelfleet.controlplane.config import ControlPlaneConfig

    def config(**given: object) -> ControlPlaneConfig:
        return ControlPlaneConfig.model_validate({"admin_token": "t" * 16, **given})

    assert not config().serves_tls  # 127.0.0.1, tls auto
    assert config(tls="on").serves_tls
    beyond = config(host="10.0.0.5")
    assert beyond.serves_tls
    assert beyond.certificate_names() == ["10.0.0.5", "127.0.0.1", "localhost"]
    with pytest.raises(ValidationError, match="plain HTTP is served on loopback only"):
        config(host="10.0.0.5", tls="off")
    with pytest.raises(ValidationError, match="name in tls_names"):
        config(host="0.0.0.0")
    every = config(host="0.0.0.0", tls_names=["cp.fleet.internal", "10.0.0.5"])
    assert every.certificate_names() == ["cp.fleet.internal", "10.0.0.5", "127.0.0.1", "localhost"]


def test_a_router_beyond_loopback_serves_tls_only(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from modelfleet.router.config import RouterConfig

    cert, key = tmp_path / "r.crt", tmp_path / "r.key"
    assert RouterConfig().client_tls is None  # loopback: plain HTTP
    with pytest.raises(ValidationError, match="beyond loopback the router serves TLS only"):
        RouterConfig(host="10.0.0.5")
    with pytest.raises(ValidationError, match="give both tls_cert and tls_key"):
        RouterConfig(tls_cert=cert)
    beyond = RouterConfig(host="10.0.0.5", tls_cert=cert, tls_key=key)
    assert beyond.client_tls == beyond.push_tls  # the push API serves the same by default
    own = tmp_path / "p.crt", tmp_path / "p.key"
    split = RouterConfig(
        host="10.0.0.5", tls_cert=cert, tls_key=key, push_tls_cert=own[0], push_tls_key=own[1]
    )
    assert split.push_tls is not None and split.push_tls.cert == own[0]
    assert RouterConfig(tls_cert=cert, tls_key=key, workers=2).client_tls is not None
    # A worker of several: TLS on the client port, its push API its parent's, on loopback.
    worker = RouterConfig(host="10.0.0.5", tls_cert=cert, tls_key=key, parent_push=True)
    assert worker.client_tls is not None and worker.push_tls is None
    assert worker.push_host == "127.0.0.1"
