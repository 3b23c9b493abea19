"""Overhead of the HTTP door against gRPC for the same rollout: samples/s and p50 latency per
sample (request sent -> that sample received), side by side on one `tltd serve --http`.

Five paths run the same seeded request (SD off: the same samples, the same engine work) in
rotating order each round, so machine noise falls on all of them alike:
  gRPC Generate (the project's RolloutClient, streamed), OpenAI /v1/completions (the official
  openai client, streamed), SGLang /generate (httpx, streamed), TRL's /v1/completions body
  (VLLMClient.generate's: one batch, not streamed), vLLM's /inference/v1/generate (token ids
  in and out, one request per prompt sent at once, as SkyRL and prime-rl send them).
A second table times the control routes trainers call around a weight update (median of
`--control-calls` calls each).

    python benchmarks/bench_http_overhead.py [--rounds 20] [--prompts 4] [--n 4]
        [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import openai  # noqa: E402

from examples.task.workload import STOP_TOKEN_ID, rollout_prompts  # noqa: E402
from tltd_clients import RolloutClient  # noqa: E402

MODEL = ROOT / "models" / "tiny-policy"
JOB = "bench-http"
PATHS = (
    "gRPC Generate",
    "HTTP /v1/completions",
    "HTTP /generate",
    "TRL /v1/completions",
    "HTTP /inference/v1/generate",
)
CONTROL = (
    ("POST", "/pause?mode=keep"),
    ("POST", "/resume"),
    ("POST", "/reset_prefix_cache"),
    ("GET", "/get_world_size"),
    ("GET", "/server_info?config_format=json"),
    ("POST", "/pause_generation"),
    ("POST", "/continue_generation"),
    ("GET", "/flush_cache"),
    ("GET", "/get_weight_version"),
)


class Serve:
    """`tltd serve --http` on free ports (SQLite in a temp dir)."""

    def __init__(self, data: Path, cpu_slots: int) -> None:
        ports = {"grpc": data / "port", "http": data / "http.port"}
        env = {k: v for k, v in os.environ.items() if not k.startswith("TLTD_")}
        env["TLTD_DRAFTER_TRAINING"] = "false"
        self.log = open(data / "tltd.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tltd", "serve", "--port", "0",
             "--port-file", str(ports["grpc"]), "--data-dir", str(data / "tltd"),
             "--cpu-slots", str(cpu_slots), "--http",
             "--http-port", "0", "--http-port-file", str(ports["http"])],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while not (ports["grpc"].exists() and ports["grpc"].read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tltd did not start: {(data / 'tltd.log').read_text()}")
            time.sleep(0.1)
        self.target = f"127.0.0.1:{ports['grpc'].read_text().strip()}"
        self.url = f"http://127.0.0.1:{ports['http'].read_text().strip()}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def run_grpc(client: RolloutClient, prompts, cfg, seed: int) -> list[float]:
    t0 = time.perf_counter()
    stream = client.stream(prompts, n=cfg.n, temperature=1.0, max_new_tokens=cfg.max_new_tokens,
                           stop_token_ids=[STOP_TOKEN_ID], seed=seed)  # fmt: skip
    return [time.perf_counter() - t0 for _ in stream]


def run_openai(oai: openai.OpenAI, prompts, cfg, seed: int) -> list[float]:
    t0 = time.perf_counter()
    chunks = oai.completions.create(
        model=JOB, prompt=prompts, n=cfg.n, max_tokens=cfg.max_new_tokens, temperature=1.0,
        seed=seed, logprobs=0, stream=True,
        extra_body={"return_token_ids": True, "stop_token_ids": [STOP_TOKEN_ID],
                    "ignore_eos": True},
    )  # fmt: skip
    return [time.perf_counter() - t0 for chunk in chunks for _ in chunk.choices]


def run_generate(http: httpx.Client, prompts, cfg, seed: int) -> list[float]:
    body = {"input_ids": prompts, "return_logprob": True, "stream": True,
            "sampling_params": {"n": cfg.n, "max_new_tokens": cfg.max_new_tokens,
                                "stop_token_ids": [STOP_TOKEN_ID], "ignore_eos": True,
                                "sampling_seed": seed}}  # fmt: skip
    t0 = time.perf_counter()
    out = []
    with http.stream("POST", f"/jobs/{JOB}/generate", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                json.loads(line[6:])  # a client parses what it receives
                out.append(time.perf_counter() - t0)
    return out


def run_trl(http: httpx.Client, prompts, cfg, seed: int) -> list[float]:
    """TRL 1.16 VLLMClient.generate's body (trl/generation/vllm_client.py), with a seed."""
    body = {"model": JOB, "prompt": prompts, "return_token_ids": True,
            "return_tokens_as_token_ids": True, "n": cfg.n, "repetition_penalty": 1.0,
            "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
            "max_tokens": cfg.max_new_tokens, "logprobs": 0, "seed": seed,
            "stop_token_ids": [STOP_TOKEN_ID], "ignore_eos": True}  # fmt: skip
    t0 = time.perf_counter()
    r = http.post("/v1/completions", json=body)
    r.raise_for_status()
    done = time.perf_counter() - t0
    return [done for _ in r.json()["choices"]]


def run_tokens(http: httpx.Client, pool: ThreadPoolExecutor, prompts, cfg, seed: int):
    params = {"n": cfg.n, "max_tokens": cfg.max_new_tokens, "temperature": 1.0,
              "logprobs": 0, "stop_token_ids": [STOP_TOKEN_ID], "ignore_eos": True,
              "output_kind": 2}  # fmt: skip
    t0 = time.perf_counter()

    def one(i: int) -> list[float]:
        body = {
            "model": JOB,
            "token_ids": prompts[i],
            "sampling_params": {**params, "seed": seed + i},
        }
        r = http.post("/inference/v1/generate", json=body)
        r.raise_for_status()
        done = time.perf_counter() - t0
        return [done for _ in r.json()["choices"]]

    return [t for got in pool.map(one, range(len(prompts))) for t in got]


def time_control(http: httpx.Client, calls: int) -> dict[str, float]:
    """Median seconds per call of each control route (paired so the job ends unpaused)."""
    out = {}
    for method, path in CONTROL:
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            http.request(method, path, json={} if method == "POST" else None).raise_for_status()
            times.append(time.perf_counter() - t0)
        out[f"{method} {path}"] = statistics.median(times)
    http.post("/resume").raise_for_status()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--rounds", type=int, default=20)  # 5 rounds scatter by +-10%
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--cpu-slots", type=int, default=1)
    parser.add_argument("--control-calls", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 1 prompt x 2")
    cfg = parser.parse_args(argv)
    if cfg.quick:
        cfg.rounds, cfg.prompts, cfg.n, cfg.max_new_tokens = 2, 1, 2, 4
        cfg.control_calls = 3
    prompts = [ids for _, ids in rollout_prompts(cfg.prompts, seed=7, model_dir=cfg.model)]
    with tempfile.TemporaryDirectory(prefix="tltd-bench-http-") as tmp:
        serve = Serve(Path(tmp), cfg.cpu_slots)
        try:
            grpc_client = RolloutClient(serve.target)
            grpc_client.create_job(cfg.model.resolve(), job_id=JOB, speculative="off",
                                   online_training=False)  # fmt: skip
            oai = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0)
            http = httpx.Client(base_url=serve.url, timeout=600)
            pool = ThreadPoolExecutor(max(1, len(prompts)))
            runners = {
                PATHS[0]: lambda seed: run_grpc(grpc_client, prompts, cfg, seed),
                PATHS[1]: lambda seed: run_openai(oai, prompts, cfg, seed),
                PATHS[2]: lambda seed: run_generate(http, prompts, cfg, seed),
                PATHS[3]: lambda seed: run_trl(http, prompts, cfg, seed),
                PATHS[4]: lambda seed: run_tokens(http, pool, prompts, cfg, seed),
            }
            for path in PATHS:  # untimed: the worker loads the model, connections open
                runners[path](10**6)
            latencies = {p: [] for p in PATHS}
            wall = dict.fromkeys(PATHS, 0.0)
            for r in range(cfg.rounds):
                k = r % len(PATHS)
                for path in PATHS[k:] + PATHS[:k]:
                    t0 = time.perf_counter()
                    got = runners[path](r)
                    wall[path] += time.perf_counter() - t0
                    assert len(got) == cfg.prompts * cfg.n, (path, len(got))
                    latencies[path] += got
            control = time_control(http, cfg.control_calls)
            pool.shutdown()
            grpc_client.close()
            oai.close()
            http.close()
        finally:
            serve.stop()
    print_table(cfg, latencies, wall)
    print_control(control)
    return 0


def print_table(cfg, latencies: dict[str, list[float]], wall: dict[str, float]) -> None:
    samples = cfg.rounds * cfg.prompts * cfg.n
    base_rate = samples / wall[PATHS[0]]
    base_p50 = statistics.median(latencies[PATHS[0]])
    print(f"{cfg.rounds} rounds x {cfg.prompts} prompts x n={cfg.n}, max {cfg.max_new_tokens} "
          f"new tokens, SD off, {cfg.cpu_slots} CPU slot(s), model {cfg.model.name}\n")  # fmt: skip
    head = "| path                        | samples/s | p50 ms/sample |"
    print(head + " samples/s vs gRPC | p50 vs gRPC |")
    print(
        "|-----------------------------|----------:|--------------:|------------------:|------------:|"
    )
    for path in PATHS:
        rate = samples / wall[path]
        p50 = statistics.median(latencies[path])
        print(f"| {path:<27} | {rate:9.1f} | {1000 * p50:13.1f} | {rate / base_rate:16.2f}x "
              f"| {p50 / base_p50:10.2f}x |")  # fmt: skip


def print_control(control: dict[str, float]) -> None:
    print("\n| control route                          | ms per call (median) |")
    print("|----------------------------------------|---------------------:|")
    for route, seconds in control.items():
        print(f"| {route:<38} | {1000 * seconds:20.2f} |")


if __name__ == "__main__":
    raise SystemExit(main())
