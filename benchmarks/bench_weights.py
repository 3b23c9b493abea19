"""Policy weight updates by disk and by gRPC push (full and delta), side by side on one
`tltd serve` over loopback: seconds per update, GB/s, bytes on the wire, and the time from the
update's start until the first request runs on the new version.

Models: the shipped policy (models/tiny-policy, fp32) and random-initialised Qwen2-shaped
models of ~100M and ~1B parameters in bf16, built on the fly (nothing is committed). Each
update is one simulated RL step: one Adam-like optimizer step at lr 1e-6 applied to fp32
master weights and cast back to the weights' dtype (in bf16 most elements do not change).

    python benchmarks/bench_weights.py [--sizes shipped,100m,1b] [--chunk-mb 4]
        [--worker-max-params 3e8]

Paths (each pushes a new version of the same job, in this order, per size):
  disk        the trainer saves a checkpoint directory (safetensors) and calls UpdatePolicy
              with its path (the daemon shares the trainer's disk; here the page cache, so
              this is the best case of a shared file system)
  grpc-full   PushPolicy with every tensor (client.push_policy(state_dict))
  grpc-delta  PushPolicy of zstd(new XOR previous) over the version the daemon holds
  gloo        OpenBroadcast: the trainer broadcasts every tensor in a torch.distributed gloo
              group the daemon opened (client.broadcast_policy), then commits
  grpc-full, recycled file
              grpc-full again in steady state: after one more (unmeasured) push, version 2
              is retired and this push is staged over its weights file (page-cache pages
              already allocated)

"wire MB" is what the client counted into the PushPolicy chunk messages it sent; the disk and
gloo paths print n/a (nothing on the trainer's side counts the bytes of a shared file system
or of gloo's transport).

Models above --worker-max-params run without a rollout worker (the daemon gets no CPU device
slot), so their first-request time is not measured: a CPU worker holds the model in fp32 and
would need ~4x the bf16 size in memory on a machine shared with others.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from tltd.v1 import rollout_pb2  # noqa: E402
from tltd_clients.client import TltClient  # noqa: E402

SHIPPED = ROOT / "models" / "tiny-policy"
JOB = "bench-weights"
LR = 1e-6

# Qwen2 shapes (vocab 32000, untied lm_head): ~100M and ~1B parameters.
SHAPES = {
    "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=True),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=20,
               num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False),
}  # fmt: skip


def build_model(size: str, out: Path) -> dict[str, torch.Tensor]:
    """A random Qwen2 checkpoint (config.json by transformers, bf16 weights) in `out`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=32000, max_position_embeddings=2048, **SHAPES[size])
    with torch.device("meta"):  # names and shapes only: the weights are drawn below, in bf16
        shapes = {k: v.shape for k, v in Qwen2ForCausalLM(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    g = torch.Generator().manual_seed(0)
    sd = {}
    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=torch.bfloat16)
        if len(shape) > 1:
            t.normal_(0, 0.02, generator=g)
        else:
            t.fill_(1.0)  # norms
        sd[name] = t
    out.mkdir(parents=True)
    cfg.torch_dtype = "bfloat16"
    cfg.save_pretrained(out)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return sd


def optimizer_step(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The next policy: Adam's first step (|update| = lr per element, random sign) on fp32
    master weights, cast back to each tensor's dtype."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in sd.items():
        sign = torch.randint(0, 2, t.shape, generator=g, dtype=torch.int8).float() * 2 - 1
        out[name] = (t.float() + LR * sign).to(t.dtype)
        del sign
    return out


class Serve:
    """`tltd serve` on a free port (SQLite in a temp dir, one CPU slot, no drafter training)."""

    def __init__(self, data: Path, cpu_slots: int = 1) -> None:
        data.mkdir(parents=True, exist_ok=True)
        self.data = data
        port = data / "port"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TLTD_")}
        env |= {
            "TLTD_DRAFTER_TRAINING": "false",
            "TLTD_WORKER_MAX_BATCH": "4",
            "TLTD_WORKER_MAX_SEQ_LEN": "64",
            "TLTD_WORKER_START_TIMEOUT_SECONDS": "900",
        }
        self.log = open(data / "tltd.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tltd", "serve", "--port", "0", "--port-file", str(port),
             "--data-dir", str(data / "tltd"), "--cpu-slots", str(cpu_slots)],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while not (port.exists() and port.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tltd did not start: {(data / 'tltd.log').read_text()}")
            time.sleep(0.1)
        self.target = f"127.0.0.1:{port.read_text().strip()}"

    def cpu_seconds(self) -> float:
        """CPU time the daemon process used so far (its threads; not its workers)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def peak_rss_mb(self) -> float:
        """The daemon process's peak resident memory so far (VmHWM; not its workers)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def broadcast_ranks(self) -> int:
        """The world size of the last broadcast group the daemon opened (from its log)."""
        sizes = re.findall(r"world_size=(\d+)", (self.data / "tltd.log").read_text())
        return int(sizes[-1]) if sizes else 0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def wait_ready(c: TltClient, timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ws = [w for w in c.list_workers() if w.kind == "rollout"]
        if ws and all(w.state == "ready" and w.job_id == JOB for w in ws):
            return
        time.sleep(0.2)
    raise TimeoutError("the rollout worker did not load the model")


def first_request(c: TltClient, version: int, started: float) -> float:
    """Seconds from `started` until a one-token request ran on `version`."""
    params = rollout_pb2.SamplingParams(n=1, max_new_tokens=1, temperature=0.0)
    samples = list(c.generate(JOB, [[1, 2, 3]], sampling=params, timeout=900))
    assert samples and samples[0].policy_version == version, samples
    return time.monotonic() - started


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def run_size(size: str, work: Path, chunk_bytes: int, worker_max_params: float) -> list[dict]:
    model_dir = work / f"{size}-v0"
    if size == "shipped":
        shutil.copytree(SHIPPED, model_dir)
        v0 = load_file(str(model_dir / "model.safetensors"))
    else:
        v0 = build_model(size, model_dir)
    params = sum(t.numel() for t in v0.values())
    total = nbytes(v0)
    dtype = str(next(iter(v0.values())).dtype).removeprefix("torch.")
    with_worker = params <= worker_max_params
    # Without a worker the daemon has no device: a worker on a cordoned device would still
    # load the job (and every pushed version) and take the CPU the transfer is measured on.
    serve = Serve(work / f"{size}-daemon", cpu_slots=1 if with_worker else 0)
    rows = []
    try:
        with TltClient(serve.target, timeout=900) as c:
            c.create_job(str(model_dir), job_id=JOB)
            if with_worker:
                wait_ready(c)

            def measure(path: str, update, new) -> None:
                started, mine, its = time.monotonic(), time.process_time(), serve.cpu_seconds()
                version, wire = update(new)
                seconds = time.monotonic() - started
                mine, its = time.process_time() - mine, serve.cpu_seconds() - its
                cpu = mine + its
                first = first_request(c, version, started) if with_worker else None
                rows.append(
                    dict(size=size, params=params, dtype=dtype, path=path, seconds=seconds,
                         gbps=total / seconds / 1e9, cpu=cpu, gbps_cpu=total / cpu / 1e9,
                         cpu_trainer=mine, cpu_daemon=its, daemon_peak_mb=serve.peak_rss_mb(),
                         wire=wire, model_bytes=total, first_request=first)
                )  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)

            v1 = optimizer_step(v0, 1)
            del v0

            # Wire bytes: what the client counted into the push's chunk messages; None (n/a)
            # where nothing counts them (a file on a shared file system, gloo's transport).
            def by_disk(v1) -> tuple[int, int | None]:
                out = work / f"{size}-v1"
                out.mkdir()
                shutil.copyfile(model_dir / "config.json", out / "config.json")
                save_file(v1, str(out / "model.safetensors"), metadata={"format": "pt"})
                return c.update_policy(JOB, str(out)).version, None

            measure("disk", by_disk, v1)
            v2 = optimizer_step(v1, 2)
            del v1

            def full(v2) -> tuple[int, int | None]:
                seen = []
                got = c.push_policy(JOB, v2, chunk_bytes=chunk_bytes, progress=seen.append)
                return got.policy.version, seen[-1].wire_bytes

            measure("grpc-full", full, v2)
            v3 = optimizer_step(v2, 3)
            changed = sum(int((bits(v3[k]) != bits(v2[k])).sum()) for k in v3)

            def delta(v3, v2=v2) -> tuple[int, int | None]:
                seen = []
                got = c.push_policy(
                    JOB,
                    v3,
                    base_version=2,
                    base_weights=v2,
                    chunk_bytes=chunk_bytes,
                    progress=seen.append,
                )
                return got.policy.version, seen[-1].wire_bytes

            measure("grpc-delta", delta, v3)
            rows[-1]["changed_share"] = changed / params
            del v2
            v4 = optimizer_step(v3, 4)
            del v3

            def gloo(v4) -> tuple[int, int | None]:
                return c.broadcast_policy(JOB, v4, timeout=900).policy.version, None

            measure("gloo", gloo, v4)
            # The trainer, the daemon and the workers that held the job (they switch from memory).
            rows[-1]["path"] = f"gloo, {serve.broadcast_ranks()} ranks"
            # Steady state: once pushed versions retire (beyond push_keep_versions, 3), the
            # daemon stages the next push over a retired version's file. The push after the
            # gloo one retires version 2 (the first grpc-full); the one after it reuses its file.
            c.push_policy(JOB, v4, chunk_bytes=chunk_bytes)
            measure("grpc-full, recycled file", full, v4)
    finally:
        serve.stop()
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| model | params | dtype | path | s/update | GB/s | CPU s (trainer + daemon) | "
        "GB per CPU s | wire MB | wire vs full | update start -> first request on it (s) | "
        "daemon peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        full = next(x for x in rows if x["size"] == r["size"] and x["path"] == "grpc-full")
        wire = f"{r['wire'] / 1e6:.1f}" if r["wire"] is not None else "n/a"
        ratio = f"{full['wire'] / r['wire']:.1f}x smaller" if r["path"] == "grpc-delta" else ""
        first = f"{r['first_request']:.2f}" if r["first_request"] is not None else "n/a"
        lines.append(
            f"| {r['size']} | {r['params'] / 1e6:.0f}M | {r['dtype']} | {r['path']} | "
            f"{r['seconds']:.2f} | {r['gbps']:.2f} | {r['cpu']:.2f} | {r['gbps_cpu']:.2f} | "
            f"{wire} | {ratio} | {first} | {r.get('daemon_peak_mb', 0):.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="shipped,100m,1b")
    ap.add_argument("--chunk-mb", type=float, default=4.0)
    ap.add_argument("--worker-max-params", type=float, default=3e8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        for size in args.sizes.split(","):
            work = Path(tmp) / size
            work.mkdir()
            rows += run_size(size, work, int(args.chunk_mb * (1 << 20)), args.worker_max_params)
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(rows))
    for r in rows:
        if r["path"] == "grpc-delta":
            print(f"{r['size']}: {100 * r['changed_share']:.2f}% of elements changed by the step")


if __name__ == "__main__":
    main()
