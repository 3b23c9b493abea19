"""Auth and TLS on the HTTP port as on the gRPC port (same tokens, roles, certificates), and
`tltd serve --http` as a real process that still stops in order on SIGTERM."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.support import ADMIN_TOKEN, TRAINER_TOKEN, make_settings, write_model_dir
from tests.http_api.support import ApiOnlyHttp
from tltd.api.interceptors import required_role
from tltd.errors import ConfigError, PermissionDenied
from tltd.http import auth
from tltd.http.errors import error_body
from tltd.services import NewJob
from tltd.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]


def _serve(store, tmp_path, **overrides) -> ApiOnlyHttp:
    settings = make_settings(tmp_path, http_enabled=True, http_port=0, **overrides)
    server = ApiOnlyHttp(settings, store).start()
    server.services.jobs.create(
        NewJob(job_id="j1", model_path=str(write_model_dir(tmp_path / "m")))
    )
    return server


def test_bearer_tokens_and_roles(sqlite_store, tmp_path):
    d = _serve(sqlite_store, tmp_path, tokens={ADMIN_TOKEN: "admin", TRAINER_TOKEN: "trainer"})
    try:
        base = f"{d.url}/v1"
        with openai.OpenAI(base_url=base, api_key="wrong", max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError) as info:
                c.models.list()
            assert info.value.body["code"] == "unauthenticated"
        anonymous = httpx.get(f"{d.url}/get_model_info")
        assert anonymous.status_code == 401 and anonymous.headers["www-authenticate"] == "Bearer"
        for token in (TRAINER_TOKEN, ADMIN_TOKEN):
            with openai.OpenAI(base_url=base, api_key=token, max_retries=0) as c:
                assert [m.id for m in c.models.list().data] == ["j1"]
                # Past auth, a daemon without workers says so: 501 (gRPC UNIMPLEMENTED).
                with pytest.raises(openai.APIStatusError) as info:
                    c.completions.create(model="j1", prompt=[1, 2], max_tokens=2)
                assert info.value.status_code == 501
        assert httpx.get(f"{d.url}/health").status_code == 200  # public, like gRPC health
    finally:
        d.stop()


def test_routes_take_the_role_of_their_grpc_method():
    # A route that stood for an admin-only RPC would refuse a trainer token with 403.
    trainer = auth.BearerAuth({TRAINER_TOKEN: "trainer", ADMIN_TOKEN: "admin"})
    auth.ROUTE_METHODS["cordon-like"] = "/tltd.v1.AdminService/Cordon"
    try:
        with pytest.raises(PermissionDenied) as info:
            trainer.check("cordon-like", f"Bearer {TRAINER_TOKEN}")
        assert error_body(info.value)[0] == 403
        trainer.check("cordon-like", f"Bearer {ADMIN_TOKEN}")
    finally:
        del auth.ROUTE_METHODS["cordon-like"]
    for route, method in auth.ROUTE_METHODS.items():
        assert required_role(method) in ("trainer", "public"), route


def test_every_route_checks_the_token(sqlite_store, tmp_path):
    """Each route of the app, vLLM's and SGLang's control routes included: no token -> 401
    (but /health), a trainer token gets past auth (whatever the route then answers)."""
    d = _serve(sqlite_store, tmp_path, tokens={TRAINER_TOKEN: "trainer"})
    try:
        from tltd.http.app import build_app

        paths = [
            (r.path.replace("{job_id}", "j1"), sorted(r.methods - {"HEAD"})[0])
            for r in build_app(d.services, {}).routes
        ]
        assert len(paths) > 40
        trainer = {"Authorization": f"Bearer {TRAINER_TOKEN}"}
        with httpx.Client(base_url=d.url, timeout=10) as http:
            for path, method in paths:
                if path.endswith("/generate") or path.endswith("/completions"):
                    continue  # a rollout: 501 without workers, checked above
                anonymous = http.request(method, path, json={})
                assert anonymous.status_code == (200 if path == "/health" else 401), path
                authed = http.request(method, path, json={}, headers=trainer)
                assert authed.status_code not in (401, 403, 500), (path, authed.text)
    finally:
        d.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    from tests.api.test_tls import make_pki  # skips without openssl, and fails under CI

    return make_pki(tmp_path_factory.mktemp("pki"))


def test_tls(sqlite_store, tmp_path, pki):
    d = _serve(
        sqlite_store,
        tmp_path,
        tokens={ADMIN_TOKEN: "admin"},
        tls_cert=pki["server.pem"],
        tls_key=pki["server.key"],
    )
    try:
        assert d.url.startswith("https://")
        ok = httpx.get(
            f"{d.url}/v1/models",
            verify=ssl.create_default_context(cafile=pki["ca.pem"]),
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        )
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "j1"
        with pytest.raises(httpx.HTTPError):  # plain HTTP to a TLS port
            httpx.get(d.url.replace("https://", "http://") + "/health", timeout=5)
        with pytest.raises(httpx.ConnectError):  # a server the client cannot verify
            httpx.get(f"{d.url}/health")
    finally:
        d.stop()


def test_mtls_requires_a_client_certificate(sqlite_store, tmp_path, pki):
    d = _serve(
        sqlite_store,
        tmp_path,
        tokens={ADMIN_TOKEN: "admin"},
        tls_cert=pki["server.pem"],
        tls_key=pki["server.key"],
        tls_client_ca=pki["ca.pem"],
    )
    try:
        ctx = ssl.create_default_context(cafile=pki["ca.pem"])
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{d.url}/health", verify=ctx, timeout=5)
        ctx.load_cert_chain(pki["client.pem"], pki["client.key"])
        assert httpx.get(f"{d.url}/health", verify=ctx).status_code == 200
    finally:
        d.stop()


def test_settings():
    s = load_settings(None, env={"TLTD_HTTP_ENABLED": "true", "TLTD_HTTP_PORT": "0"})
    assert s.http_enabled and s.http_port == 0
    assert not load_settings(None, env={}).http_enabled  # off by default
    with pytest.raises(ConfigError, match="http_port"):
        load_settings(None, env={"TLTD_HTTP_PORT": "70000"})


def test_tltd_serve_with_http_stops_in_order_on_sigterm(tmp_path):
    port_file = tmp_path / "http.port"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLTD_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tltd",
            "serve",
            "--port",
            "0",
            "--cpu-slots",
            "0",
            "--data-dir",
            str(tmp_path / "data"),
            "--http",
            "--http-port",
            "0",
            "--http-port-file",
            str(port_file),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port_file.read_text().strip()}"
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/v1/models").json() == {"object": "list", "data": []}
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "tltd stopped" in out  # the daemon's own shutdown ran: SIGTERM was not taken
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_draining_node_is_503_on_health_and_new_rollouts(sqlite_store, tmp_path):
    d = _serve(sqlite_store, tmp_path)
    try:
        d.services.node.start_draining("test")
        assert httpx.get(f"{d.url}/health").status_code == 503
        r = httpx.post(f"{d.url}/v1/completions", json={"model": "j1", "prompt": [1, 2]})
        assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
        assert httpx.get(f"{d.url}/v1/models").status_code == 200  # reads still served
    finally:
        d.stop()
