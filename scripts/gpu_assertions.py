"""What the GPU check demands of each step's figures before it counts the GPU's work as done.

Each function takes a step's `figures` (as `scripts/gpu_check.py` records them) and returns
findings, one line each; no finding means the step's results show CUDA doing the work. On a
real check a finding fails its step; on a dry run (CPU) every function must return a finding
for the CPU's figures, or the check could pass without a GPU and the dry run fails.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Figures = dict[str, Any]


def _devices(listing: Any) -> list[dict[str, Any]]:
    """The device list of `tltctl devices -o json` (a list, or {"devices": [...]})."""
    if isinstance(listing, dict):
        listing = listing.get("devices", [])
    return [d for d in listing or [] if isinstance(d, dict)]


def env_findings(fig: Figures) -> list[str]:
    """torch sees a CUDA device and NVML answers with a driver version."""
    found = []
    if fig.get("cuda_available") is not True:
        found.append("torch sees no CUDA device")
    if not fig.get("driver"):
        found.append(f"NVML gave no driver version ({fig.get('nvml', 'no answer')})")
    return found


def inventory_findings(fig: Figures) -> list[str]:
    """The daemon lists CUDA devices only, and marks the one a foreign process holds foreign."""
    devs = _devices(fig.get("devices"))
    kinds = sorted({str(d.get("kind", "")) for d in devs})
    found = []
    if "cuda" not in kinds:
        found.append(f"no CUDA device in the daemon's inventory (kinds {kinds})")
    if "cpu" in kinds:
        found.append("the daemon fell back to CPU slots (NVML failed or found no GPU)")
    if "devices_beside_foreign" not in fig:
        return [*found, "no inventory was taken beside a foreign process"]
    pid = int(fig.get("foreign_pid") or -1)
    after = _devices(fig["devices_beside_foreign"])
    holders = [d for d in after if any(int(p.get("pid", 0)) == pid for p in d.get("processes", []))]
    if not holders:
        found.append(f"the foreign process (pid {pid}) is listed on no device")
    for d in holders:
        if d.get("foreign") is not True:
            found.append(f"{d.get('device_id')} lists the foreign pid {pid} but is not foreign")
        ours = [p for p in d.get("processes", []) if int(p.get("pid", 0)) == pid and p.get("ours")]
        if ours:
            found.append(f"{d.get('device_id')} counts the foreign pid {pid} as the daemon's")
    return found


def demo_findings(fig: Figures) -> list[str]:
    """The demo's daemon listed a CUDA device and every rollout worker it ran was on CUDA."""
    devs = fig.get("devices") or []
    found = []
    if not any(d.get("kind") == "cuda" for d in devs):
        kinds = sorted({str(d.get("kind")) for d in devs})
        found.append(
            f"the demo's daemon had no CUDA device (kinds {kinds}): CPU slots did the work"
        )
    rollout = [w for w in fig.get("workers") or [] if w.get("kind") == "rollout"]
    if not rollout:
        found.append("the demo's daemon ran no rollout worker")
    off = sorted(
        {w.get("device_id") for w in rollout if not str(w.get("device_id")).startswith("cuda")}
    )
    if off:
        found.append(f"rollout workers ran off CUDA, on {off}")
    if not fig.get("samples"):
        found.append("the demo's daemon stored no samples")
    return found


def tests_findings(fig: Figures) -> list[str]:
    """Some tests put tensors on CUDA (counted per test by the test suite's CUDA allocations)."""
    if int(fig.get("cuda_tests", 0)) <= 0:
        return [f"none of the {fig.get('tests', 0)} tests allocated a tensor on CUDA"]
    return []


def verify_findings(fig: Figures) -> list[str]:
    """Every row was timed on CUDA with CUDA time > 0, and the SD bound uses a measured a."""
    rows = fig.get("rows") or []
    found = []
    if not rows:
        found.append("no step costs were measured")
    if not str(fig.get("device", "")).startswith("cuda"):
        found.append(f"step costs measured on {fig.get('device')!r}, not CUDA")
    idle = [f"{r.get('model')}/{r.get('dtype')}/b{r.get('batch')}" for r in rows
            if not (r.get("decode_cuda_ms") or 0) > 0]  # fmt: skip
    if idle:
        found.append(f"no CUDA time in {len(idle)} row(s), e.g. {idle[0]}")
    if not fig.get("accepted"):
        found.append("the SD bound has no measured accepted length (the spec step measures it)")
    return found


def spec_findings(fig: Figures) -> list[str]:
    """bench_spec ran on CUDA and allocated there, and measured an accepted length."""
    found = []
    if not str(fig.get("device", "")).startswith("cuda"):
        found.append(f"bench_spec ran on {fig.get('device')!r}, not CUDA")
    if not (fig.get("cuda_max_memory_bytes") or 0) > 0:
        found.append("bench_spec allocated nothing on CUDA")
    if not fig.get("measured_accepted_length"):
        found.append("bench_spec measured no accepted length (no SD step ran)")
    return found


def preemption_findings(fig: Figures) -> list[str]:
    """The drafter trainer of the preemption benchmark was put on CUDA, and rows came back."""
    found = []
    if not str(fig.get("device", "")).startswith("cuda"):
        found.append(f"the preempted trainer ran on {fig.get('device')!r}, not CUDA")
    if not fig.get("rows"):
        found.append("no preemption was measured")
    return found


FINDINGS: dict[str, Callable[[Figures], list[str]]] = {
    "env": env_findings,
    "inventory": inventory_findings,
    "demo": demo_findings,
    "tests": tests_findings,
    "spec": spec_findings,
    "verify": verify_findings,
    "preemption": preemption_findings,
}


def gpu_findings(step: str, fig: Figures) -> list[str]:
    """The findings of `step`'s GPU assertion on `fig` (none: CUDA did the step's work)."""
    return FINDINGS[step](fig)
