"""`tltctl cordon|drain --node ID` through one daemon for another one: the request goes
through the database, the other node acts on it (a notification, else its heartbeat)."""

from __future__ import annotations

import json
import time

import pytest

from tests.api.support import run_tltctl
from tests.multinode.conftest import Cluster
from tltd.v1 import rollout_pb2
from tltd_clients.errors import UnavailableError


def _until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(0.05)
    raise TimeoutError(what)


def test_cordon_and_drain_another_node(cluster: Cluster, capsys, monkeypatch) -> None:
    a, b = cluster.start("a"), cluster.start("b")
    monkeypatch.delenv("TLTD_TOKEN", raising=False)
    monkeypatch.setenv("TLTD_TARGET", a.target)

    code, out, err = run_tltctl(capsys, "cordon", "--node", "b", "--reason", "disk check")
    assert code == 0, err
    with b.client() as c:
        assert all(d.cordoned and not d.draining for d in c.list_devices())
        assert not c.stats().draining  # a cordon places no new work; the node still serves
    with a.client() as c:
        assert not any(d.cordoned for d in c.list_devices())  # a's own devices untouched
    code, out, _ = run_tltctl(capsys, "nodes", "-o", "json")
    flags = {n["node_id"]: n.get("cordoned", False) for n in json.loads(out)}
    assert flags == {"a": False, "b": True}
    code, out, err = run_tltctl(capsys, "uncordon", "--node", "b")
    assert code == 0, err
    with b.client() as c:
        assert not any(d.cordoned for d in c.list_devices())
    code, _, err = run_tltctl(capsys, "cordon", "cpu:0", "--node", "b")
    assert code != 0 and "not both" in err

    code, out, err = run_tltctl(capsys, "drain", "--node", "b", "--grace", "5")
    assert code == 0 and "draining" in out, err
    with b.client() as c:
        _until(lambda: c.stats().draining, timeout=10, what="node b draining")
        assert all(d.draining for d in c.list_devices())
        with pytest.raises(UnavailableError, match="draining"):
            list(c.generate("any", [[1, 2]], sampling=rollout_pb2.SamplingParams(n=1)))
    with a.client() as c:
        assert not c.stats().draining  # the node that relayed it serves on
        nodes = {n.node_id: n for n in c.list_nodes()}
        assert nodes["b"].draining and not nodes["a"].draining
    code, _, err = run_tltctl(capsys, "drain", "--node", "nosuch")
    assert code != 0 and "nosuch" in err
