"""Pushed policy weights through a real daemon and real workers: the workers run the pushed
weights, and a push whose trainer was killed midway leaves the old version serving."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from tests.api.support import sampling
from tests.rollout.support import direct_outputs, wait_until
from tltd.domain import SamplingParams
from tltd_clients.errors import NotFoundError

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
GREEDY = dict(n=2, temperature=0.0, max_new_tokens=16)
ROOT = Path(__file__).resolve().parents[2]


def _by_key(samples) -> dict:
    return {(s.prompt_index, s.sample_index): tuple(s.token_ids) for s in samples}


def test_workers_run_the_pushed_weights(sqlite_daemon, ckpt, ckpt2):
    d = sqlite_daemon
    sd = load_file(str(ckpt2 / "model.safetensors"))
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        before = list(c.generate("job", PROMPTS, sampling=sampling(**GREEDY)))
        got = c.push_policy("job", sd, chunk_bytes=4096)
        assert got.policy.version == 1
        after = list(c.generate("job", PROMPTS, sampling=sampling(**GREEDY)))
        stored = load_file(str(Path(got.policy.path) / "model.safetensors"))
    assert {s.policy_version for s in before} == {0}
    assert {s.policy_version for s in after} == {1}
    assert stored.keys() == sd.keys() and all(stored[k].equal(sd[k]) for k in sd)
    # The tokens prove which weights the workers ran, not just the label.
    assert _by_key(before) == direct_outputs(ckpt, PROMPTS, SamplingParams(**GREEDY))
    assert _by_key(after) == direct_outputs(ckpt2, PROMPTS, SamplingParams(**GREEDY))


_SLOW_PUSHER = """
import sys, time
from safetensors.torch import load_file
from tltd_clients.client import TltClient

sd = load_file(sys.argv[2])
with TltClient(sys.argv[1]) as c:
    c.push_policy("job", sd, update_id="doomed", chunk_bytes=512,
                  progress=lambda p: time.sleep(0.05))
"""


def test_a_push_killed_midway_leaves_no_version_and_the_old_one_serving(sqlite_daemon, ckpt, ckpt2):
    d = sqlite_daemon
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        trainer = subprocess.Popen(
            [sys.executable, "-c", _SLOW_PUSHER, d.target, str(ckpt2 / "model.safetensors")],
            cwd=ROOT,
            env=os.environ | {"PYTHONPATH": str(ROOT)},
        )
        try:

            def held() -> int:
                try:
                    return c.get_push("job", "doomed").bytes_received
                except NotFoundError:
                    return 0

            wait_until(lambda: held() > 0, timeout=60, what="push under way")
        finally:
            os.kill(trainer.pid, signal.SIGKILL)
            trainer.wait()
        status = c.get_push("job", "doomed")
        assert 0 < status.bytes_received < status.bytes_total and status.version == 0
        assert c.get_job("job").policy_version == 0
        samples = list(c.generate("job", PROMPTS, sampling=sampling(**GREEDY)))
        assert {s.policy_version for s in samples} == {0}
        assert _by_key(samples) == direct_outputs(ckpt, PROMPTS, SamplingParams(**GREEDY))
        # Abandoned: dropped with its files once idle for push_idle_seconds.
        pushes = d.daemon.services.pushes
        staged = pushes.staging_root / "job" / "doomed"
        assert staged.is_dir()
        wait_until(lambda: not pushes._pushes["job", "doomed"].attached, what="stream gone")
        assert pushes.collect(time.monotonic() + pushes.idle_seconds + 1) == ["doomed"]
        assert not staged.exists() and not (pushes.versions_root / "job").exists()
        try:
            c.get_push("job", "doomed")
            raise AssertionError("the dropped push is still known")
        except NotFoundError:
            pass
        assert [v.version for v in d.store.list_policy_versions("job")] == [0]


_BROADCASTER = """
import json, sys
from safetensors.torch import load_file
from tltd_clients.client import TltClient

sd = load_file(sys.argv[2])
with TltClient(sys.argv[1]) as c:
    got = c.broadcast_policy("job", sd, update_id="by-gloo", timeout=120)
print(json.dumps({"version": got.policy.version, "path": got.policy.path}))
"""


def test_a_gloo_broadcast_from_the_trainer_becomes_the_version_the_workers_run(
    sqlite_daemon, ckpt, ckpt2
):
    d = sqlite_daemon
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        out = subprocess.run(
            [sys.executable, "-c", _BROADCASTER, d.target, str(ckpt2 / "model.safetensors")],
            cwd=ROOT,
            env=os.environ | {"PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["version"] == 1
        assert c.get_policy("job", 1).source == "push"
        samples = list(c.generate("job", PROMPTS, sampling=sampling(**GREEDY)))
    sd = load_file(str(ckpt2 / "model.safetensors"))
    stored = load_file(str(Path(got["path"]) / "model.safetensors"))
    assert stored.keys() == sd.keys() and all(stored[k].equal(sd[k]) for k in sd)
    assert {s.policy_version for s in samples} == {1}
    assert _by_key(samples) == direct_outputs(ckpt2, PROMPTS, SamplingParams(**GREEDY))
