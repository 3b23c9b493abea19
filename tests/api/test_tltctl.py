"""`tltctl` against an in-process daemon: tables, JSON for scripts, one error boundary."""

from __future__ import annotations

import json

import pytest

from tests.api.support import ADMIN_TOKEN, TRAINER_TOKEN
from tests.api.support import run_tltctl as run
from tltd.domain import DrafterStatus, DrafterVersion, SamplingParams


@pytest.fixture
def ctl(auth_daemon, capsys, monkeypatch):
    monkeypatch.delenv("TLTD_TOKEN", raising=False)
    monkeypatch.setenv("TLTD_TARGET", auth_daemon.target)

    def ctl(*args: str, token: str | None = ADMIN_TOKEN):
        return run(capsys, *(["--token", token] if token else []), *args)

    return ctl


def test_status_and_devices(ctl):
    code, out, err = ctl("status")
    assert code == 0 and err == ""
    assert "uptime_seconds" in out and "SERVING" in out and "sqlite" in out
    assert "queued=0" in out  # maps render as k=v pairs
    assert "cpu:0=idle cpu:1=idle" in out  # every device's state, live
    code, out, _ = ctl("status", "-o", "json")
    data = json.loads(out)
    assert data["health"] == "SERVING" and data["devices"] == 2 and data["database"] == "sqlite"
    assert data["samples_total"] == 0 and data["requests_by_status"]["queued"] == 0  # uint64s
    assert data["device_states"] == {"cpu:0": "idle", "cpu:1": "idle"}

    code, out, _ = ctl("devices")
    assert code == 0 and "DEVICE" in out and "cpu:0" in out and "cpu:1" in out
    code, out, _ = ctl("-o", "json", "devices")  # -o before the subcommand works too
    assert [d["device_id"] for d in json.loads(out)] == ["cpu:0", "cpu:1"]
    code, out, _ = ctl("workers", "-o", "json")
    assert code == 0 and json.loads(out) == []
    code, out, _ = ctl("workers")
    assert code == 0 and "WORKER" in out


def test_jobs(ctl, auth_daemon, model_dir):
    with auth_daemon.client(TRAINER_TOKEN) as c:
        c.create_job(str(model_dir), job_id="job-1", name="grpo")
    code, out, _ = ctl("jobs", "ls")
    assert code == 0 and "job-1" in out and "grpo" in out and "active" in out
    code, out, _ = ctl("jobs", "show", "job-1", "-o", "json")
    assert json.loads(out)["status"] == "JOB_STATUS_ACTIVE"
    code, out, _ = ctl("jobs", "cancel", "job-1", "--reason", "operator says so")
    assert code == 0 and "cancelled" in out and "operator says so" in out
    code, out, _ = ctl("jobs", "ls", "--status", "active", "-o", "json")
    assert json.loads(out) == []
    code, out, _ = ctl("jobs", "ls", "--status", "cancelled", "-o", "json")
    assert [j["job_id"] for j in json.loads(out)] == ["job-1"]
    code, out, _ = ctl("jobs", "-o", "json", "ls")  # -o works anywhere on the line
    assert [(j["job_id"], j["policy_version"]) for j in json.loads(out)] == [("job-1", 0)]
    code, out, err = ctl("jobs", "ls", "--limit", "-1")
    assert code == 2 and out == "" and "--limit" in err and "Traceback" not in err


def test_jobs_create(ctl, auth_daemon, model_dir):
    args = ("jobs", "create", str(model_dir), "--job-id", "job-2", "--name", "ppo")
    options = (
        *("--priority", "2", "--weight", "0.5", "--backend", "torch", "--speculative", "auto"),
        *("--draft-lengths", "2,4", "--drafter", "ngram", "--batch-threshold", "8"),
        "--no-online-training",
        *("--policy-switch", "next-step"),
    )
    # trainers own their jobs' lifecycle: a trainer token may create
    code, out, err = ctl(*args, *options, "-o", "json", token=TRAINER_TOKEN)
    assert code == 0 and err == ""
    job = json.loads(out)
    assert (
        job["job_id"] == "job-2" and job["name"] == "ppo" and job["status"] == "JOB_STATUS_ACTIVE"
    )
    assert job["priority"] == 2 and job["weight"] == 0.5 and job["backend"] == "BACKEND_TORCH"
    assert job["speculative"] == {
        "mode": "SPECULATIVE_MODE_AUTO",
        "batch_threshold": 8,
        "draft_lengths": [2, 4],
        "drafter": "ngram",
        "online_training": False,
        "initial_drafter_path": "",
    }
    assert job["policy_switch"] == "POLICY_SWITCH_NEXT_STEP"
    stored = auth_daemon.store.jobs.get("job-2")
    assert stored.speculative.draft_lengths == (2, 4) and not stored.speculative.online_training
    assert stored.policy_switch.value == "next_step"

    # Defaults: the daemon assigns the id and fills in its defaults; a table for people.
    code, out, _ = ctl("jobs", "create", str(model_dir), "--name", "grpo")
    assert code == 0 and "job_id" in out and "grpo" in out and "active" in out
    assert "online_training=True" in out and "batch_threshold=32" in out
    code, out, _ = ctl("jobs", "ls")
    assert code == 0 and "job-2" in out and "ppo" in out and "grpo" in out
    assert {j["name"] for j in json.loads(ctl("jobs", "ls", "-o", "json")[1])} == {"ppo", "grpo"}
    code, out, _ = ctl(*args, *options, "-o", "json")  # a retry: the same job, not a new one
    assert code == 0 and json.loads(out)["created_at"] == job["created_at"]
    code, out, err = ctl(*args)  # the same job id with other parameters
    assert code == 1 and err.startswith("tltctl: already_exists:") and "job-2" in err


@pytest.mark.parametrize(
    "extra, status, field",
    [
        (("--draft-lengths", "2,0"), "invalid_argument", "speculative.draft_lengths[1]"),
        (("--weight", "-1"), "invalid_argument", "weight"),
        (("--job-id", "bad id"), "invalid_argument", "job_id"),
        (
            ("--speculative", "off", "--initial-drafter", "/nowhere"),
            "invalid_argument",
            "speculative.initial_drafter_path",
        ),
        (("--backend", "sglang"), "failed_precondition", "backend"),
    ],
)
def test_jobs_create_bad_field(ctl, auth_daemon, model_dir, extra, status, field):
    code, out, err = ctl("jobs", "create", str(model_dir), *extra)
    assert code == 1 and out == ""
    assert err.startswith(f"tltctl: {status}: {field}:"), err
    assert auth_daemon.store.jobs.list() == []  # nothing was created


def test_jobs_create_bad_model_path(ctl, auth_daemon, tmp_path):
    code, out, err = ctl("jobs", "create", str(tmp_path / "nowhere"))
    assert code == 1 and out == ""
    assert err.startswith("tltctl: invalid_argument: model_path:") and "nowhere" in err
    code, out, err = ctl("jobs", "create", str(tmp_path), "--draft-lengths", "2,-1")
    assert code == 2 and "--draft-lengths" in err  # refused before anything is sent
    assert json.loads(ctl("jobs", "ls", "-o", "json")[1]) == []


def test_drafters(ctl, auth_daemon, model_dir):
    with auth_daemon.client(ADMIN_TOKEN) as c:
        c.create_job(str(model_dir), job_id="job")
    auth_daemon.store.drafters.add(
        DrafterVersion(
            job_id="job",
            version=1,
            policy_version=0,
            path="/d/1",
            train_steps=50,
            loss=0.25,
            acceptance_length=3.5,
        )
    )
    auth_daemon.store.drafters.set_status("job", 1, DrafterStatus.PROMOTED, "better")
    code, out, _ = ctl("drafters", "ls", "job")
    assert code == 0 and "promoted" in out and "3.50" in out and "active drafter version 1" in out
    code, out, _ = ctl("drafters", "ls", "job", "-o", "json")
    assert json.loads(out)["active_version"] == 1  # uint64: a number, not proto JSON's string
    assert json.loads(out)["drafters"][0]["policy_version"] == 0
    code, out, _ = ctl("drafters", "-o", "json", "show", "job", "1")  # -o on the group too
    assert json.loads(out)["train_steps"] == 50
    code, out, _ = ctl("drafters", "pin", "job", "1", "-o", "json")
    assert json.loads(out)["drafter"]["pinned"] is True
    code, out, err = ctl("drafters", "export", "job", "1", "--output-dir", "/tmp/x")
    # /d/1 does not exist: one clear error line, exit 1 (a real export is tested in test_rpc)
    assert code == 1 and out == "" and "failed_precondition" in err.lower() and "/d/1" in err


def test_sessions(ctl, auth_daemon, model_dir):
    with auth_daemon.client(TRAINER_TOKEN) as c:
        c.create_job(str(model_dir), job_id="job")
        c.open_session("job", [1, 2, 3], session_id="ep-1")
        c.open_session("job", [4], session_id="ep-2")
        c.close_session("ep-2")
    # a turn recorded RUNNING (this daemon has no workers to run it)
    auth_daemon.store.sessions.begin_turn("ep-1", 0, (), SamplingParams(max_new_tokens=4))
    code, out, err = ctl("sessions")
    assert code == 0 and err == ""
    assert "SESSION" in out and "RUNNING" in out
    row = next(line.split() for line in out.splitlines() if line.startswith("ep-1"))
    assert row[:6] == ["ep-1", "job", "0", "3", "open", "0"]  # turns, tokens, state, running
    code, out, _ = ctl("sessions", "--status", "closed", "-o", "json", token=TRAINER_TOKEN)
    assert [(s["session_id"], s["running_turn"]) for s in json.loads(out)] == [("ep-2", -1)]
    code, out, _ = ctl("sessions", "--job", "nope", "-o", "json")
    assert code == 0 and json.loads(out) == []
    code, out, err = ctl("sessions", "--job", "bad id!")
    assert code == 1 and "job_id" in err


def test_cordon_uncordon_drain(ctl, auth_daemon):
    code, out, _ = ctl("cordon", "cpu:0", "--reason", "fan")
    assert code == 0 and "cordoned" in out
    assert auth_daemon.store.devices.get("cpu:0").cordoned
    assert "cpu:0=idle(cordoned) cpu:1=idle" in ctl("status")[1]
    code, out, _ = ctl("uncordon", "cpu:0", "-o", "json")
    assert json.loads(out)[0]["cordoned"] is False
    code, out, _ = ctl("drain", "cpu:1")
    assert code == 0 and "draining" in out
    code, out, err = ctl("drain")
    assert code == 2 and "DEVICE_ID or --node" in err  # usage error, nothing sent
    code, out, err = ctl("drain", "cpu:0", "--grace", "5")  # was accepted and ignored
    assert code == 2 and "--grace applies to --node only" in err
    assert not auth_daemon.store.devices.get("cpu:0").draining
    code, out, _ = ctl("drain", "--node", "-o", "json")
    assert code == 0 and all(d["draining"] for d in json.loads(out))
    assert auth_daemon.node.draining


def test_error_boundary(ctl, capsys, monkeypatch):
    code, out, err = ctl("cordon", "cpu:0", token=TRAINER_TOKEN)
    assert code == 1 and out == ""
    assert err.startswith("tltctl: permission_denied:") and "Cordon" in err
    code, out, err = ctl("jobs", "show", "ghost")
    assert code == 1 and "not_found" in err and "ghost" in err
    code, out, err = ctl("status", token=None)
    assert code == 1 and "unauthenticated" in err
    monkeypatch.setenv("TLTD_TOKEN", ADMIN_TOKEN)  # the env var carries the token
    assert ctl("status", token=None)[0] == 0
    code, out, err = run(capsys, "--target", "127.0.0.1:1", "status")
    assert code == 1 and "unavailable" in err

    def refuse(*_args, **_kw):  # what protobuf raises for a value a field cannot carry
        raise ValueError("Value out of range: 18446744073709551616")

    monkeypatch.setattr("tltd_clients.client.TltClient.stats", refuse)
    code, out, err = ctl("status")
    assert code == 2 and out == "" and err.startswith("tltctl: invalid input: Value out of range")


def test_nodes(ctl, auth_daemon):
    """A node that joined the database shows up in `tltctl nodes` (`tltd serve` joins at
    start; this API-only daemon joins here)."""
    auth_daemon.store.nodes.join("127.0.0.1:1", down_seconds=30.0)
    code, out, err = ctl("nodes")
    assert code == 0 and err == "" and "NODE" in out and "EPOCH" in out
    code, out, _ = ctl("nodes", "-o", "json")
    [node] = json.loads(out)
    assert node["state"] == "up" and int(node["epoch"]) >= 1
    assert node["node_id"] == auth_daemon.store.node_id
    assert node["heartbeat_age_seconds"] < 30
