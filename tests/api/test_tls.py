"""Real TLS and mTLS with certificates generated in the test (openssl CLI)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from tests.api.support import ADMIN_TOKEN, DaemonThread, make_settings, run_tltctl, seed_devices
from tests.ci import skip_unless_ci
from tltd_clients.errors import UnavailableError


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> dict[str, str]:
    """A CA, a server cert for 127.0.0.1/localhost and a client cert, all signed by the CA
    (no openssl CLI: the test is skipped, and failed under CI)."""
    if shutil.which("openssl") is None:
        skip_unless_ci("needs the openssl CLI")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        cwd=d,
    )
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            cwd=d,
        )
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            f"{name}.ext",
            "-out",
            f"{name}.pem",
            cwd=d,
        )
    return {
        n: str(d / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")
    }


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _daemon(store, tmp_path, **tls) -> DaemonThread:
    seed_devices(store)
    settings = make_settings(tmp_path, tokens={ADMIN_TOKEN: "admin"}, **tls)
    return DaemonThread(settings, store).start()


def test_tls(sqlite_store, tmp_path, pki):
    d = _daemon(sqlite_store, tmp_path, tls_cert=pki["server.pem"], tls_key=pki["server.key"])
    try:
        with d.client(ADMIN_TOKEN, tls_ca=pki["ca.pem"]) as c:
            assert c.stats().devices == 2 and c.health() == "SERVING"
        # A plaintext client cannot talk to a TLS port.
        with d.client(ADMIN_TOKEN) as c, pytest.raises(UnavailableError):
            c.stats()
    finally:
        d.stop()


def test_mtls_requires_a_client_certificate(sqlite_store, tmp_path, pki):
    d = _daemon(
        sqlite_store,
        tmp_path,
        tls_cert=pki["server.pem"],
        tls_key=pki["server.key"],
        tls_client_ca=pki["ca.pem"],
    )
    try:
        with d.client(
            ADMIN_TOKEN, tls_ca=pki["ca.pem"], tls_cert=pki["client.pem"], tls_key=pki["client.key"]
        ) as c:
            assert c.stats().devices == 2
        with d.client(ADMIN_TOKEN, tls_ca=pki["ca.pem"]) as c:
            with pytest.raises(UnavailableError) as info:
                c.stats()
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        d.stop()


def test_tltctl_over_mtls(sqlite_store, tmp_path, pki, capsys):
    d = _daemon(
        sqlite_store,
        tmp_path,
        tls_cert=pki["server.pem"],
        tls_key=pki["server.key"],
        tls_client_ca=pki["ca.pem"],
    )
    try:
        code, out, err = run_tltctl(
            capsys,
            "--target",
            d.target,
            "--token",
            ADMIN_TOKEN,
            "--tls-ca",
            pki["ca.pem"],
            "--tls-cert",
            pki["client.pem"],
            "--tls-key",
            pki["client.key"],
            "devices",
        )
        assert code == 0 and "cpu:0" in out, err
    finally:
        d.stop()


def test_client_certificate_without_its_key_is_refused(pki, capsys):
    """gRPC's C core aborts the process (SIGABRT) when given only one of the pair."""
    import asyncio

    from tltd_clients import AsyncRolloutClient, RolloutClient, TltClient

    half_pairs = [{"tls_cert": pki["client.pem"]}, {"tls_key": pki["client.key"]}]
    for half in half_pairs:
        for make in (TltClient, RolloutClient, AsyncRolloutClient):
            with pytest.raises(ValueError, match="tls_cert|tls_key"):
                make("127.0.0.1:1", tls_ca=pki["ca.pem"], **half)

    async def built_in_a_loop():  # the async client checks at construction too, not on use
        AsyncRolloutClient("127.0.0.1:1", tls_cert=pki["client.pem"])

    with pytest.raises(ValueError, match="tls_key"):
        asyncio.run(built_in_a_loop())
    for flag, path in (("--tls-cert", pki["client.pem"]), ("--tls-key", pki["client.key"])):
        code, out, err = run_tltctl(capsys, "--target", "127.0.0.1:1", flag, path, "status")
        assert code == 2 and out == "" and "--tls-cert and --tls-key" in err
