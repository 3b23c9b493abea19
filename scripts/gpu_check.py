"""The prepared GPU check: the torch backend, NVML and the daemon on a lent CUDA device, one report.

Run through `scripts/gpu_check.sh` (which installs the carried wheels first), or with
`--dry-run` on a CPU: the same steps on `cpu` with small sizes, so that the script cannot rot.
Each step runs as a subprocess under its own time limit and within one overall budget; a step
that fails or runs out of time is recorded and the next one runs. What it writes to `--out`:

    report.json  every step: status, seconds, command, figures, failures, the end of its log
    report.txt   the same for a reader, with each step's table
    logs.txt     every step's whole output

Every step's figures then go through its GPU assertion (`scripts/gpu_assertions.py`): on a
real check a finding fails the step; on a dry run the assertions must reject the CPU's figures
(a dry run whose CPU results pass a GPU assertion fails), and `--dry-run --strict` applies them
as on a GPU, so that it fails on a CPU. The report's format is described in docs/backends.md
("The GPU check").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.gpu_assertions import gpu_findings  # noqa: E402

PY = sys.executable
TEST_DIRS = ["tests/engine", "tests/spec", "tests/drafter"]
DRY_TESTS = ["tests/engine/test_engine_model.py", "tests/engine/test_engine_batching.py"]


@dataclass
class StepResult:
    name: str
    status: str = "skipped"  # ok | failed | timeout | skipped
    seconds: float = 0.0
    command: list[str] = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    log_tail: str = ""


@dataclass
class Check:
    """What every step needs: where it runs, its scratch folder, the budget left, the logs."""

    device: str
    dry: bool
    tmp: Path
    deadline: float
    strict: bool = True  # the GPU assertions fail steps (off on a dry run unless --strict)
    accepted: float | None = None  # the accepted length the spec step measured
    logs: list[str] = field(default_factory=list)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, res: StepResult, cmd: list[str], limit: float, env: dict | None = None) -> str:
        """Run `cmd` under min(limit, budget left); record status, time and output in `res`."""
        res.command = cmd
        limit = min(limit, self.left())
        if limit < 5:
            res.status, res.failures = "skipped", ["no time left in the budget"]
            return ""
        t0 = time.monotonic()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=limit)  # fmt: skip
            text, res.status = p.stdout + p.stderr, "ok" if p.returncode == 0 else "failed"
            if p.returncode:
                res.failures.append(f"exit status {p.returncode}")
        except subprocess.TimeoutExpired as exc:
            text = _text(exc.stdout) + _text(exc.stderr)
            res.status, res.failures = "timeout", [f"killed after {limit:.0f} s"]
        res.seconds = round(time.monotonic() - t0, 1)
        self.logs.append(f"===== {res.name}: {' '.join(cmd)}\n{text}")
        res.log_tail = text[-3000:]
        return text


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def step_env(c: Check) -> StepResult:
    """Import the project and read what torch and NVML say of the machine."""
    res = StepResult("env")
    probe = (
        "import json, torch, pynvml, tltd, tltd_workers, tltd_clients, grpc, sqlalchemy\n"
        "d = {'python': __import__('sys').version.split()[0], 'torch': torch.__version__,\n"
        "     'cuda': torch.version.cuda, 'cuda_available': torch.cuda.is_available(),\n"
        "     'grpc': grpc.__version__, 'sqlalchemy': sqlalchemy.__version__}\n"
        "if torch.cuda.is_available():\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    d |= {'gpu': p.name, 'capability': list(torch.cuda.get_device_capability(0)),\n"
        "          'gpu_memory_gib': round(p.total_memory / 2**30, 1),\n"
        "          'bf16': torch.cuda.is_bf16_supported()}\n"
        "try:\n"
        "    pynvml.nvmlInit(); d['driver'] = pynvml.nvmlSystemGetDriverVersion()\n"
        "except pynvml.NVMLError as e:\n"
        "    d['nvml'] = str(e)\n"
        "print(json.dumps(d))\n"
    )
    text = c.run(res, [PY, "-c", probe], 60)
    if res.status == "ok":
        res.figures = json.loads(text.strip().splitlines()[-1])
    return res


def step_tests(c: Check) -> StepResult:
    """The engine, SD-losslessness and drafter tests on the device (`pytest --device`)."""
    res = StepResult("tests")
    junit = c.tmp / "tests.xml"
    cmd = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--device", c.device,
           f"--junitxml={junit}", "-o", "addopts=-ra --strict-markers"]  # fmt: skip
    # Each test on a CUDA device records its CUDA allocations (tests/conftest.py) as a
    # property of its JUnit case: only tests that allocated there count as run on CUDA.
    cmd += DRY_TESTS + ["-k", "greedy or logits"] if c.dry else TEST_DIRS
    if not c.dry and _has("xdist"):
        cmd += ["-n", "6"]  # the GPU machine has 16 cores; the tests are small
    c.run(res, cmd, 100 if c.dry else 240)
    if junit.exists():
        res.figures, res.failures = _junit(junit, res.failures)
    return res


def _has(module: str) -> bool:
    return subprocess.run([PY, "-c", f"import {module}"], capture_output=True).returncode == 0


def _junit(path: Path, failures: list[str]) -> tuple[dict, list[str]]:
    """Counts, the failed tests (name: first line of the message) and `cuda_tests` (passed
    tests whose `cuda_allocations` property is > 0) of a JUnit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in
              ("tests", "failures", "errors", "skipped")}  # fmt: skip
    counts["cuda_tests"] = 0
    for case in root.iter("testcase"):
        bads = [*case.findall("failure"), *case.findall("error")]
        for bad in bads:
            msg = (bad.get("message") or "").strip().splitlines()
            failures.append(f"{case.get('classname')}::{case.get('name')}: {msg[0] if msg else ''}")
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        ran = not bads and case.find("skipped") is None
        counts["cuda_tests"] += ran and int(props.get("cuda_allocations") or 0) > 0
    return counts, failures


class Daemon:
    """`tltd serve` with no --cpu-slots: it finds the GPU through NVML (CPU slots where none)."""

    def __init__(self, c: Check, name: str, env: dict | None = None) -> None:
        data = c.tmp / name
        data.mkdir()
        self.port_file, self.log = data / "port", open(data / "tltd.log", "w")  # noqa: SIM115
        self.log_path = data / "tltd.log"
        self.proc = subprocess.Popen(
            [PY, "-m", "tltd", "serve", "--port", "0", "--port-file", str(self.port_file),
             "--data-dir", str(data / "state")],
            cwd=ROOT, env={**os.environ, **(env or {})}, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 90
        while not (self.port_file.exists() and self.port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"tltd did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        self.target = f"127.0.0.1:{self.port_file.read_text().strip()}"

    def tltctl(self, *args: str) -> str:
        cmd = [PY, "-m", "tltd_clients.tltctl", "--target", self.target, *args]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True,
                              timeout=30).stdout  # fmt: skip

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        return self.proc.returncode


FOREIGN = (
    "import time, torch\n"
    "x = torch.ones(1 << 28, device='cuda')  # 1 GiB of float32\n"
    "print('holding', flush=True)\n"
    "time.sleep(120)\n"
)


def step_inventory(c: Check) -> StepResult:
    """The daemon's NVML path: `tltctl devices -o json`, then again beside a foreign process."""
    res = StepResult("inventory", command=["tltd serve", "tltctl devices -o json"])
    t0 = time.monotonic()
    try:
        d = Daemon(c, "inventory", {"TLTD_DEVICE_REFRESH_SECONDS": "1"})
    except RuntimeError as exc:
        res.status, res.failures = "failed", [str(exc)]
        return res
    foreign = None
    try:
        res.figures["devices"] = json.loads(d.tltctl("devices", "-o", "json"))
        if not c.dry:
            foreign = subprocess.Popen([PY, "-c", FOREIGN], stdout=subprocess.PIPE, text=True)
            foreign.stdout.readline()  # allocated
            time.sleep(3)  # > two refreshes of 1 s
            res.figures["foreign_pid"] = foreign.pid
            res.figures["devices_beside_foreign"] = json.loads(d.tltctl("devices", "-o", "json"))
        res.status = "ok"
    except (subprocess.SubprocessError, json.JSONDecodeError, ValueError) as exc:
        res.status, res.failures = "failed", [f"{type(exc).__name__}: {exc}"]
    finally:
        if foreign is not None:
            foreign.kill()
        code = d.stop()
        c.logs.append(f"===== inventory: daemon log\n{d.log_path.read_text()}")
        res.log_tail = d.log_path.read_text()[-3000:]
    res.figures["daemon_exit_status"] = code
    res.seconds = round(time.monotonic() - t0, 1)
    return res


def step_demo(c: Check) -> StepResult:
    """`grpo_demo.py --quick`: GRPO through a real daemon, then what its store says ran where."""
    res = StepResult("demo")
    work = c.tmp / "demo"
    text = c.run(res, [PY, "examples/grpo_demo.py", "--quick", "--work-dir", str(work)], 240)
    res.figures["summary"] = [ln for ln in text.splitlines() if "x" in ln and (
        "speedup" in ln or "faster" in ln or "logprob" in ln)][-6:]  # fmt: skip
    db = work / "tltd" / "tltd.db"
    if db.exists():
        res.figures |= _demo_store(db)
    else:
        res.failures.append(f"the demo's daemon left no database at {db}")
    return res


def _demo_store(db: Path) -> dict:
    """The demo daemon's devices, its workers' kinds and devices, and its sample count."""
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
        devices = con.execute("SELECT device_id, kind FROM devices").fetchall()
        workers = con.execute("SELECT kind, device_id FROM workers").fetchall()
        (samples,) = con.execute("SELECT count(*) FROM samples").fetchone()
    return {
        "devices": [{"device_id": d, "kind": k} for d, k in devices],
        "workers": [{"kind": k, "device_id": d} for k, d in workers],
        "samples": samples,
    }


def step_verify(c: Check) -> StepResult:
    """bench_verify_cost: decode / verify / draft-step ms per batch, shipped and random shapes,
    and the roofline projection of each bf16 random-shape row beside it (with its error)."""
    res = StepResult("verify")
    base = [PY, "benchmarks/bench_verify_cost.py", "--device", c.device, "--threads", "4"]
    small = ["--batches", "1,4", "--repeats", "2", "--context", "64"] if c.dry else [
        "--batches", "1,4,16,32,64", "--repeats", "10"]  # fmt: skip
    shapes = "tiny" if c.dry else "qwen2-0.5b,qwen2-1.5b"
    runs = [
        ("shipped", [*base, *small, "--dtypes", "float32,bfloat16"]),
        ("random", [*base, *small, "--dtypes", "bfloat16", "--shape", shapes, "--no-shipped"]),
    ]
    if c.accepted:  # the SD bound at the accepted length the spec step measured here
        runs = [(label, [*cmd, "--accepted", f"{c.accepted:.3f}"]) for label, cmd in runs]
    rows, statuses, meta = [], [], {}
    for label, cmd in runs:
        out = c.tmp / f"verify-{label}.json"
        part = StepResult(res.name)
        c.run(part, [*cmd, "--json", str(out)], 60 if c.dry else 150)
        statuses.append(part.status)
        res.failures += part.failures
        res.seconds += part.seconds
        res.command, res.log_tail = part.command, part.log_tail
        if out.exists():
            meta = json.loads(out.read_text())
            rows += meta.pop("rows")
    res.status = next((s for s in statuses if s != "ok"), "ok")
    res.figures = {"device": c.device, "accepted": c.accepted, "rows": rows}
    if c.accepted:
        res.figures["accepted_source"] = "bench_spec adaptive mode, last epoch (spec step)"
    res.figures["device_name"] = meta.get("device_name", c.device)
    res.figures["projection"] = _projection(rows, meta)
    return res


def _projection(rows: list[dict], meta: dict) -> dict:
    """The roofline projection of each measured row and its error (benchmarks/projection_error);
    where it cannot be computed, why, so that the measured rows are kept either way."""
    try:
        from benchmarks.projection_error import compare, figures, lines

        comp = compare(rows, str(meta.get("device_name", "")), meta["context"], meta["k"])
    except Exception as exc:  # noqa: BLE001 -- a check step records a failure, it never dies of one
        line = f"projection vs measurement: not computed ({type(exc).__name__}: {exc})"
        return {"error": line, "lines": [line]}
    return figures(comp) | {"lines": lines(comp)}


def step_preemption(c: Check) -> StepResult:
    """bench_preemption on the device: "preempt" sent -> the trainer reports the device free."""
    res = StepResult("preemption")
    out = c.tmp / "preemption.json"
    cmd = [PY, "benchmarks/bench_preemption.py", "--device", c.device, "--json", str(out),
           "--preemptions", "3" if c.dry else "12"]  # fmt: skip
    c.run(res, cmd, 90 if c.dry else 120)
    if out.exists():
        res.figures = json.loads(out.read_text())
    return res


def step_spec(c: Check) -> StepResult:
    """bench_spec on the device: SD off, adaptive and adaptive + history drafts over two epochs
    of the same prompts, on the shipped policy and drafter."""
    res = StepResult("spec")
    out = c.tmp / "spec.json"
    cmd = [PY, "benchmarks/bench_spec.py", "--device", c.device, "--modes", "off,adaptive,history"]
    cmd += ["--epochs", "2", "--json", str(out)] + (["--quick"] if c.dry else ["--repeats", "1"])
    c.run(res, cmd, 120 if c.dry else 200)
    if out.exists():
        res.figures = json.loads(out.read_text())
        last = res.figures["epochs"][-1] if res.figures.get("epochs") else {}
        c.accepted = (last.get("adaptive") or {}).get("mean_accepted_length") or None
        res.figures["measured_accepted_length"] = c.accepted
    return res


STEPS: dict[str, Callable[[Check], StepResult]] = {
    "env": step_env,
    "inventory": step_inventory,
    "demo": step_demo,
    "tests": step_tests,
    "spec": step_spec,  # before verify: its measured accepted length goes into the SD bound
    "verify": step_verify,
    "preemption": step_preemption,
}


def judge(c: Check, res: StepResult) -> None:
    """Apply the step's GPU assertion. Strict: a finding fails the step. Dry: the assertion must
    reject the CPU's figures, or it could pass without a GPU and the step fails."""
    if res.status == "skipped":
        return
    found = gpu_findings(res.name, res.figures)
    if c.strict:
        res.failures += found
        res.status = "failed" if found and res.status == "ok" else res.status
        return
    res.figures["dry_run_gpu_assertion_rejects"] = found
    if not found:
        res.status = "failed"
        res.failures.append(f"the GPU assertion of {res.name} accepted CPU results")


def write_report(out: Path, c: Check, results: list[StepResult], budget: float) -> None:
    """report.json, report.txt and logs.txt under `out`."""
    env = next((r.figures for r in results if r.name == "env"), {})
    report = {
        "device": c.device,
        "dry_run": c.dry,
        "gpu_assertions": "applied" if c.strict else "dry: must reject these CPU results",
        "machine": env,
        "budget_seconds": budget,
        "seconds": round(sum(r.seconds for r in results), 1),
        "ok": all(r.status == "ok" for r in results),
        "steps": [asdict(r) for r in results],
    }
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "logs.txt").write_text("\n".join(c.logs)[-8_000_000:])
    lines = [f"{'DRY RUN (no GPU figures): ' if c.dry else ''}"
             f"tltd GPU check on {c.device} ({env.get('gpu', 'no GPU')}), "
             f"{report['seconds']} s of a {budget:.0f} s budget, GPU assertions "
             f"{report['gpu_assertions']}: "
             f"{'all steps ok' if report['ok'] else 'FAILURES'}"]  # fmt: skip
    if c.dry and not c.strict:
        lines.append("Every step ran on the CPU; '~' lines are what each GPU assertion found "
                     "wrong with the CPU's results, as it must.")  # fmt: skip
    for r in results:
        lines.append(f"\n== {r.name}: {r.status} ({r.seconds} s)")
        lines += [f"   ! {f}" for f in r.failures[:40]]
        lines += [f"   ~ {f}" for f in r.figures.get("dry_run_gpu_assertion_rejects", [])]
        if r.name == "preemption":
            lines.append("\n".join(r.log_tail.splitlines()[-5:]))
        elif r.name in ("verify", "spec", "demo"):
            lines.append(_table_lines(r.log_tail))
            lines += (r.figures.get("projection") or {}).get("lines", [])
        elif r.figures:
            lines.append("   " + json.dumps(r.figures, default=str)[:1500])
    (out / "report.txt").write_text("\n".join(lines) + "\n")


def _table_lines(text: str) -> str:
    """The table rows and result lines of a benchmark's output."""
    keep = [ln for ln in text.splitlines() if ln.startswith("|") or "x" in ln[:80] and ":" in ln]
    return "\n".join(keep[-40:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="the same steps on cpu, small sizes")
    ap.add_argument(
        "--strict", action="store_true", help="with --dry-run: apply the GPU assertions (fails)"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for all steps")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"some of {','.join(STEPS)}")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="tltd-gpu-check-") as tmp:
        strict = args.strict or not args.dry_run
        c = Check("cpu" if args.dry_run else args.device, args.dry_run, Path(tmp),
                  time.monotonic() + args.budget, strict=strict)  # fmt: skip
        for name in args.steps.split(","):
            print(f"[gpu-check] {name} ({c.left():.0f} s of the budget left)", flush=True)
            results.append(STEPS[name](c))
            r = results[-1]
            judge(c, r)
            print(f"[gpu-check] {name}: {r.status} in {r.seconds} s", flush=True)
        write_report(args.out, c, results, args.budget)
    print((args.out / "report.txt").read_text())
    return 0 if all(r.status == "ok" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
