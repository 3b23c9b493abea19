"""Helpers for the API tests: a real tltd gRPC server (grpc.aio, port 0) on its own event loop
in a thread, settings, model directories on disk, and an assertion on failed calls."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from tltd.api.server import build_server
from tltd.domain import Device, DeviceKind
from tltd.services import NodeState, Services, build_services
from tltd.settings import Settings, load_settings
from tltd.v1 import rollout_pb2
from tltd_clients.client import TltClient
from tltd_clients.errors import TltClientError
from tltd_clients.tltctl import main as tltctl_main

VOCAB = 100
# Daemons under test time the measured gate's costs at a worker's load for 0.2 s, not the
# default 2 s: every worker load pays it, what these tests check does not depend on the gate's
# priors (tests/spec checks those), and batch sizes not timed are timed online.
TEST_COST_BUDGET_SECONDS = 0.2
ADMIN_TOKEN = "admin-secret-token"
TRAINER_TOKEN = "trainer-secret-token"


class DaemonThread:
    """The API server exactly as the daemon builds it, on its own event loop in a thread, so
    tests can use the ordinary synchronous client (no pytest-asyncio needed)."""

    def __init__(self, settings: Settings, store) -> None:
        self.settings = settings
        self.store = store
        self.node = NodeState()
        self.services: Services = build_services(store, settings, self.node)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.api = None

    def start(self) -> DaemonThread:
        self._thread.start()

        async def start():
            self.api = build_server(self.settings, self.services)
            await self.api.start()

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(timeout=30)
        return self

    @property
    def port(self) -> int:
        return self.api.port

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self, token: str | None = None, **kw) -> TltClient:
        return TltClient(kw.pop("target", self.target), token=token, **kw)

    def stop(self) -> None:
        if self.api is not None:
            asyncio.run_coroutine_threadsafe(self.api.stop(0), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()


def make_settings(tmp_path: Path, **overrides) -> Settings:
    """Settings as the daemon would load them, with no file and an empty environment."""
    values = {
        "port": 0,
        "data_dir": str(tmp_path / "data"),
        "worker_cost_budget_seconds": TEST_COST_BUDGET_SECONDS,
    } | overrides
    return load_settings(None, env={}, overrides=values)


def write_model_dir(path: Path, vocab: int = VOCAB, weights: bool = True) -> Path:
    """A directory that passes the daemon's checks (config.json [+ *.safetensors]); no real
    weights are needed because nothing loads them in these tests."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": vocab}))
    if weights:
        (path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return path


def write_checkpoint(path: Path, config: dict) -> Path:
    """A real HF checkpoint: random weights saved by `transformers` for `config`, which is
    then config.json exactly (the daemon checks a policy update's tensors against it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(config))
    return path


def seed_devices(store, n: int = 2) -> list[Device]:
    return store.devices.upsert(
        [
            Device(device_id=f"cpu:{i}", kind=DeviceKind.CPU, index=i, name="cpu slot")
            for i in range(n)
        ]
    )


@contextmanager
def fails(code: grpc.StatusCode, *needles: str) -> Iterator[pytest.ExceptionInfo]:
    """The call fails with `code` and a message containing every needle (e.g. the field)."""
    with pytest.raises(TltClientError) as info:
        yield info
    assert info.value.code == code, info.value
    for needle in needles:
        assert needle in info.value.message, (needle, info.value.message)


def sampling(**kw) -> rollout_pb2.SamplingParams:
    """Valid sampling parameters (max_new_tokens must be > 0), overridden by `kw`."""
    return rollout_pb2.SamplingParams(**({"max_new_tokens": 8} | kw))


def run_tltctl(capsys, *args: str) -> tuple[int, str, str]:
    """Run `tltctl` in-process through its real entry point: (exit status, stdout, stderr)."""
    with pytest.raises(SystemExit) as info:
        tltctl_main(list(args))
    out, err = capsys.readouterr()
    return info.value.code, out, err
