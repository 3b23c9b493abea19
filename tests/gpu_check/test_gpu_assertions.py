"""The GPU check's assertions reject CPU results (gpu-check-dry can fail) and accept GPU ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.gpu_assertions import FINDINGS, gpu_findings, inventory_findings
from scripts.gpu_check import Check, StepResult, _junit, judge

ROOT = Path(__file__).resolve().parents[2]


def _dev(device_id: str, kind: str, procs: list[dict] | None = None, foreign: bool = False):
    # tltctl devices -o json: MessageToDict keeps every field, uint64 as strings
    return {"device_id": device_id, "kind": kind, "processes": procs or [], "foreign": foreign,
            "memory_total_bytes": "100", "state": "idle"}  # fmt: skip


# What each step records on a CPU (the shapes of a dry run's figures).
CPU = {
    "env": {"python": "3.11", "torch": "2.13.0+cpu", "cuda": None, "cuda_available": False,
            "nvml": "NVML Shared Library Not Found"},
    "inventory": {"devices": [_dev("cpu:0", "cpu"), _dev("cpu:1", "cpu")]},
    "demo": {"devices": [{"device_id": "cpu:0", "kind": "cpu"}],
             "workers": [{"kind": "rollout", "device_id": "cpu:0"},
                         {"kind": "drafter_training", "device_id": "cpu:1"}], "samples": 24},
    "tests": {"tests": 12, "failures": 0, "errors": 0, "skipped": 0, "cuda_tests": 0},
    "spec": {"device": "cpu", "cuda_max_memory_bytes": 0, "measured_accepted_length": 2.4,
             "epochs": [{"off": {"seconds": 3.0}, "adaptive": {"mean_accepted_length": 2.4}}]},
    "verify": {"device": "cpu", "accepted": 2.4, "rows": [
        {"model": "shipped", "dtype": "float32", "batch": 1, "decode_ms": 3.0,
         "decode_cuda_ms": 0.0}]},
    "preemption": {"device": "cpu", "rows": [{"p50_ms": 20.0}]},
}  # fmt: skip

FOREIGN_PID = 4242
GPU = {
    "env": {"cuda_available": True, "gpu": "NVIDIA H200", "driver": "580.1"},
    "inventory": {
        "devices": [_dev("cuda:0", "cuda", [{"pid": 10, "ours": True}])],
        "foreign_pid": FOREIGN_PID,
        "devices_beside_foreign": [_dev("cuda:0", "cuda", [{"pid": FOREIGN_PID, "ours": False,
                                                            "used_memory_bytes": "1"}], True)],
    },
    "demo": {"devices": [{"device_id": "cuda:0", "kind": "cuda"}],
             "workers": [{"kind": "rollout", "device_id": "cuda:0"}], "samples": 24},
    "tests": {"tests": 175, "cuda_tests": 120},
    "spec": {"device": "cuda", "cuda_max_memory_bytes": 1 << 30, "measured_accepted_length": 3.1},
    "verify": {"device": "cuda", "accepted": 3.1, "rows": [
        {"model": "shipped", "dtype": "bfloat16", "batch": 1, "decode_cuda_ms": 5.2}]},
    "preemption": {"device": "cuda", "rows": [{"p50_ms": 20.0}]},
}  # fmt: skip


@pytest.mark.parametrize("step", sorted(FINDINGS))
def test_each_gpu_assertion_rejects_cpu_results(step):
    assert gpu_findings(step, CPU[step])


@pytest.mark.parametrize("step", sorted(FINDINGS))
def test_each_gpu_assertion_accepts_gpu_results(step):
    assert gpu_findings(step, GPU[step]) == []


def test_a_foreign_pid_on_a_device_not_marked_foreign_is_a_finding():
    """The JSON always holds the word "foreign" ("foreign": false): the field is what counts."""
    fig = json.loads(json.dumps(GPU["inventory"]))
    fig["devices_beside_foreign"][0]["foreign"] = False
    assert "foreign" in json.dumps(fig["devices_beside_foreign"])
    assert any("not foreign" in f for f in inventory_findings(fig))
    fig["devices_beside_foreign"][0]["processes"] = []
    assert any("listed on no device" in f for f in inventory_findings(fig))


def test_the_demo_on_cpu_slots_beside_a_gpu_is_a_finding():
    """A CUDA device listed while the rollouts ran on a CPU slot still fails."""
    fig = {**GPU["demo"], "workers": [{"kind": "rollout", "device_id": "cpu:0"}]}
    assert any("off CUDA" in f for f in gpu_findings("demo", fig))


def test_only_passed_tests_that_allocated_on_cuda_count(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">'
        '<testcase classname="a" name="on_cuda"><properties>'
        '<property name="cuda_allocations" value="37"/></properties></testcase>'
        '<testcase classname="a" name="host_only"><properties>'
        '<property name="cuda_allocations" value="0"/></properties></testcase>'
        '<testcase classname="a" name="failed"><failure message="boom"/><properties>'
        '<property name="cuda_allocations" value="5"/></properties></testcase>'
        '<testcase classname="a" name="skipped"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    counts, failures = _junit(xml, [])
    assert counts["tests"] == 4 and counts["cuda_tests"] == 1
    assert failures == ["a::failed: boom"]


def _check(tmp_path: Path, strict: bool) -> Check:
    return Check("cpu", dry=True, tmp=tmp_path, deadline=0.0, strict=strict)


def test_a_dry_run_fails_when_a_gpu_assertion_accepts_cpu_results(tmp_path):
    res = StepResult("spec", status="ok", figures=dict(GPU["spec"]))  # as if CPU had passed
    judge(_check(tmp_path, strict=False), res)
    assert res.status == "failed" and "accepted CPU results" in res.failures[0]
    res = StepResult("spec", status="ok", figures=dict(CPU["spec"]))
    judge(_check(tmp_path, strict=False), res)
    assert res.status == "ok" and res.figures["dry_run_gpu_assertion_rejects"]
    judge(_check(tmp_path, strict=True), res := StepResult("spec", "ok", figures=CPU["spec"]))
    assert res.status == "failed"


def _run_check(tmp_path: Path, *args: str) -> tuple[int, dict]:
    cmd = [sys.executable, "scripts/gpu_check.py", "--dry-run", "--out", str(tmp_path), *args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    return p.returncode, json.loads((tmp_path / "report.json").read_text())


def test_the_dry_run_exits_non_zero_when_its_gpu_assertions_are_applied(tmp_path):
    code, report = _run_check(tmp_path / "strict", "--strict", "--steps", "env")
    assert code == 1 and not report["ok"] and report["gpu_assertions"] == "applied"
    assert "torch sees no CUDA device" in report["steps"][0]["failures"]
    code, report = _run_check(tmp_path / "dry", "--steps", "env")
    assert code == 0 and report["dry_run"] and report["gpu_assertions"].startswith("dry")
    assert "torch sees no CUDA device" in report["steps"][0]["figures"][
        "dry_run_gpu_assertion_rejects"]  # fmt: skip
