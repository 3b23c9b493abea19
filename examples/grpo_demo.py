"""README command 1: GRPO on the toy running-sum task with the tiny policy, rolling out through
a real `tltd serve`, once with TLT (adaptive speculative decoding) and once with it off.

    python examples/grpo_demo.py            # 8 RL steps (4 epochs) per mode, held-out scores
    python examples/grpo_demo.py --quick    # 2 tiny steps per mode, a smoke test
    python examples/grpo_demo.py --http     # roll out through the openai client (HTTP door)
    python examples/grpo_demo.py --no-async # without the asynchronous TLT run
    python examples/grpo_demo.py --trace DIR  # record the engines' steps (sim_rollout.py)

After the two synchronous runs, an asynchronous TLT run (examples/async_grpo.py) rolls out the
next steps while the trainer updates, and is compared with the synchronous SD-off run.

Each RL step: sample prompts -> the daemon rolls out n answers per prompt (temperature 1) ->
score them with the task's reward -> group-normalised advantages -> one clipped policy-gradient
update of the HF policy (logprobs recomputed by the trainer) -> save an HF checkpoint -> push it
with UpdatePolicy. Both modes use the same prompts and seeds from the same initial weights.
While it runs, `TLTD_TARGET=<printed address> tltctl status` shows every device's state.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

# Runnable as `python examples/grpo_demo.py` from anywhere.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.async_grpo import AsyncOutcome, print_async_summary, run_async  # noqa: E402
from examples.cpu_time import demo_cpu, torch_threads  # noqa: E402
from examples.curves import CURVE_N, Curves, curve_config  # noqa: E402
from examples.demo_report import (  # noqa: E402
    HEADER,
    MODES,
    StepRow,
    Window,
    plot,
    print_row,
    print_summary,
)
from examples.grpo_trainer import GRPOTrainer, Scored, group_advantages  # noqa: E402
from examples.heldout import HeldOutScore, score_samples  # noqa: E402
from examples.sampling_law import TokenLaw, token_law  # noqa: E402
from examples.shadow import ShadowMeter  # noqa: E402
from examples.task import decode, load_tokenizer, reward  # noqa: E402
from examples.task.dataset import HELD_OUT_SAMPLING_SEED, TaskDataset, build_dataset  # noqa: E402
from examples.task.workload import MAX_NEW_TOKENS, STOP_TOKEN_ID  # noqa: E402
from tltd_clients import RolloutClient, RolloutSample, TltClientError, by_prompt  # noqa: E402

MODEL = ROOT / "models" / "tiny-policy"
# An EAGLE drafter fitted offline on MODEL (scripts/fit_drafter.py): the TLT run starts from it
# (its drafter version 1) and online training keeps it aligned as the policy moves.
DRAFTER = ROOT / "models" / "tiny-policy-eagle"
# The trainer's setting: AdamW lr and clipped updates per rollout batch (each pass recomputes
# the logprobs and clips the ratio against the daemon's), and no KL penalty towards the initial
# policy, as in DAPO; the penalty's reference forward was a quarter of the update's compute.
# These were chosen among ~15 settings of benchmarks/bench_rl_trend.py scored on the held-out
# set, before the task had a validation split, so that set took part in choosing them.
# bench_rl_trend.py now compares settings on the validation split (docs/demo.md, "Which split
# chose what").
DEMO_LR = 2e-4
DEMO_PASSES = 1
DEMO_KL = 0.0


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 8  # 4 epochs of the training set
    prompts: int = 16  # per step; 16+ prompts: every step's workload has the long tail
    train_prompts: int = 32  # the fixed training set, iterated in shuffled epochs
    held_out_prompts: int = 32  # scored before and after each run, paired
    n: int = 8
    held_out_n: int = 16  # samples per held-out prompt
    max_new_tokens: int = MAX_NEW_TOKENS
    lr: float = DEMO_LR  # --lr
    passes: int = DEMO_PASSES
    kl: float = DEMO_KL  # --kl
    seed: int = 0
    cpu_slots: int = 2


# Two steps of one prompt set: the second step's samples carry the pushed policy version 1.
QUICK = DemoConfig(
    steps=2, prompts=2, train_prompts=2, held_out_prompts=2, n=4, held_out_n=4, max_new_tokens=128
)


# ---- the daemon ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    """`tltd serve` on the embedded defaults (SQLite under `data_dir`, torch backend, CPU slots).
    `trace_dir`: its torch workers record their engines' steps there (`engine_trace_dir`)."""

    def __init__(
        self, data_dir: Path, cpu_slots: int, http: bool = False, trace_dir: Path | None = None
    ) -> None:
        self.data_dir = data_dir
        self.trace_dir = trace_dir
        self.port_file = data_dir / "port"
        http_port_file = data_dir / "http.port"
        self.log_path = data_dir / "tltd.log"
        self.metrics_port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TLTD_")}
        # The trainer's update runs on these same 2 cores: drafter training fills the
        # rollout's tail and yields when the rollout ends (docs/drafter.md, training_window).
        env["TLTD_TRAINING_WINDOW"] = "rollout"
        # A step's tail lasts seconds here: a slot the tail leaves idle trains after 0.5 s
        # (the default 2 s suits a node whose requests come and go at any time), a new round
        # may start 5 s after the last one did (default 30 s: an RL step is ~20 s here),
        # rounds are 16 optimizer steps and a candidate is measured on 8 held-out samples
        # (defaults 50 and 32), so that rounds and their measurements fit in one run's tails.
        env["TLTD_TRAINING_IDLE_GRACE_SECONDS"] = "0.5"
        env["TLTD_TRAINING_CADENCE_SECONDS"] = "5"
        env["TLTD_TRAINING_STEPS_PER_ROUND"] = "16"
        env["TLTD_TRAINING_HELD_OUT_SAMPLES"] = "8"
        # The drafter's trainer is spawned at the job's first sample and waits, loaded, for
        # the first tail: its start-up (seconds here) would otherwise take that tail.
        env["TLTD_TRAINING_WARM_START"] = "true"
        if trace_dir is not None:
            env["TLTD_ENGINE_TRACE_DIR"] = str(trace_dir)
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "tltd", "serve", "--port", "0",
                "--port-file", str(self.port_file), "--data-dir", str(data_dir / "tltd"),
                "--cpu-slots", str(cpu_slots), "--metrics-port", str(self.metrics_port),
                *(["--http", "--http-port", "0", "--http-port-file", str(http_port_file)]
                  if http else []),
            ],
            cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while not (self.port_file.exists() and self.port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"tltd did not start; its log:\n{self.log_path.read_text()}")
            time.sleep(0.1)
        self.target = f"127.0.0.1:{self.port_file.read_text().strip()}"
        # --http: rollouts and weight pushes go through the HTTP door (examples/http_rollouts.py)
        self.http_url = f"http://127.0.0.1:{http_port_file.read_text().strip()}" if http else ""

    def device_seconds(self) -> dict[str, float]:
        """Device-seconds so far per device state, summed over devices (metrics endpoint), and
        "loading": those of a training device whose trainer was still starting up."""
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "tltd_device_state_seconds_total":
                    out[s.labels["state"]] = out.get(s.labels["state"], 0.0) + s.value
                elif s.name == "tltd_device_trainer_loading_seconds_total":
                    out["loading"] = out.get("loading", 0.0) + s.value
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return int(self.proc.returncode)


# ---- one RL step ---------------------------------------------------------------------------


def rollout(
    client: RolloutClient,
    prompts: list[list[int]],
    cfg: DemoConfig,
    seed: int,
    label: str,
    speculative: str | None = None,
) -> tuple[list[RolloutSample], list[float], float]:
    """Stream the step's samples, showing progress; (samples, finish times, wall time).
    `speculative` overrides the job's mode for this request ("off" | "auto")."""
    total = len(prompts) * cfg.n
    samples: list[RolloutSample] = []
    finished: list[float] = []
    start = last_shown = time.perf_counter()
    override = {} if speculative is None else {"speculative": speculative}
    stream = client.stream(
        prompts, n=cfg.n, temperature=1.0, max_new_tokens=cfg.max_new_tokens,
        stop_token_ids=[STOP_TOKEN_ID], seed=seed, **override,
    )  # fmt: skip
    tty = sys.stdout.isatty()
    for sample in stream:
        now = time.perf_counter()
        samples.append(sample)
        finished.append(now - start)
        # A terminal gets a live line every second; a log gets a line every 15 s.
        if now - last_shown > (1.0 if tty else 15.0) or (tty and len(samples) == total):
            last_shown = now
            devices = ", ".join(f"{d.device_id} {d.state}" for d in client.raw.list_devices())
            line = f"  {label}: {len(samples):4d}/{total} samples {now - start:6.1f}s [{devices}]"
            print(f"\r{line:<100}" if tty else line, end="" if tty else "\n", flush=True)
    if tty:
        print("\r" + " " * 100 + "\r", end="", flush=True)
    return samples, finished, time.perf_counter() - start


def pick_then_roll_out(
    client: RolloutClient,
    job_id: str,
    prompts: list[list[int]],
    cfg: DemoConfig,
    seed: int,
    label: str,
) -> tuple[int, tuple[list[RolloutSample], list[float], float]]:
    """The job's drafter version in service before the step's rollout begins, then the rollout.
    That version is what the shadow scores as "used": promoted before any of the step's samples
    existed, it never trained on them (a version promoted during the step may have)."""
    in_service = int(client.raw.get_job(job_id).drafter_version)
    return in_service, rollout(client, prompts, cfg, seed=seed, label=label)


def tail_seconds(finish_times: list[float]) -> float:
    """Time from the moment 90% of the samples were done until the last one was."""
    times = sorted(finish_times)
    if not times:
        return 0.0
    k = max(0, min(len(times) - 1, int(0.9 * len(times) + 0.999) - 1))
    return times[-1] - times[k]


def score(samples: list[RolloutSample], prompts, problems, tok) -> list[Scored]:
    """Rewards and GRPO advantages, one group per prompt."""
    groups = by_prompt(samples)
    rewards = [[reward(problems[g[0].prompt_index], decode(tok, s.token_ids)) for s in g]
               for g in groups]  # fmt: skip
    advantages = group_advantages(rewards)
    return [
        Scored(prompts[s.prompt_index], s.token_ids, s.logprobs, r, a)
        for g, rs, adv in zip(groups, rewards, advantages, strict=True)
        for s, r, a in zip(g, rs, adv, strict=True)
    ]


class Run:
    """One RL run (one job, one trainer) with speculative decoding adaptive (tlt) or off."""

    def __init__(
        self,
        mode: str,
        cfg: DemoConfig,
        daemon: Daemon,
        dataset: TaskDataset,
        model: Path,
        drafter: Path | None = None,
    ) -> None:
        self.mode, self.cfg, self.daemon, self.dataset, self.model = (
            mode, cfg, daemon, dataset, model,
        )  # fmt: skip
        self.job_id = f"grpo-{mode}"
        self.tok = load_tokenizer(model)
        self.trainer = GRPOTrainer(model, lr=cfg.lr, seed=cfg.seed, kl_coef=cfg.kl)
        self.law_rng = torch.Generator().manual_seed(cfg.seed)  # the PITs' own draws
        self.client = RolloutClient(daemon.target)
        tlt = mode == "tlt"
        self.client.create_job(
            model,
            job_id=self.job_id,
            speculative="auto" if tlt else "off",
            online_training=tlt,  # the baseline has no drafter to train
            initial_drafter=drafter if tlt else None,
        )
        self.shadow = ShadowMeter(model, drafter) if tlt and drafter is not None else None
        if daemon.http_url:
            from examples.http_rollouts import HttpRollouts

            self.client = HttpRollouts(daemon.http_url, self.job_id, self.client)
        self.rows: list[StepRow] = []

    def warm_up(self) -> None:
        """Not timed: the job's workers load the model on first use."""
        warm = self.dataset.held_out[0][1]
        self.client.generate([warm], n=1, temperature=0.0, max_new_tokens=4)

    def step(self, step: int) -> StepRow:
        """Roll out (timed), score, update the policy and push it (timed: the update)."""
        cfg, seed = self.cfg, self.cfg.seed * 1000 + step  # the same in both modes
        work = self.dataset.batch(step)
        problems = [p for p, _ in work]
        prompts = [ids for _, ids in work]
        at_start = self.daemon.device_seconds()
        cpu = [demo_cpu(self.daemon.proc.pid)]
        in_service, (samples, finish, rollout_s) = pick_then_roll_out(
            self.client, self.job_id, prompts, cfg, seed=seed, label=f"{self.mode} step {step}"
        )
        self.record_step(step, rollout_s, len(samples))
        cpu.append(demo_cpu(self.daemon.proc.pid))
        at_rollout_end = self.daemon.device_seconds()
        # Not in the step's time: measurements. Their wall time and what the daemon did
        # meanwhile (drafter training's wind-down) are recorded apart.
        t_meas = time.perf_counter()
        shadow = self.measure_shadow(samples, prompts, in_service)
        law = self.measure_law(samples, prompts)
        measure_s = time.perf_counter() - t_meas
        at_update = self.daemon.device_seconds()
        cpu.append(demo_cpu(self.daemon.proc.pid))
        t0 = time.perf_counter()
        scored = score(samples, prompts, problems, self.tok)
        # The first pass starts from the weights that sampled: its gap checks the daemon's
        # logprobs; later passes clip their ratio against those same logprobs. The update has
        # every core: the rollout is over and drafter training yields outside the rollouts
        # (training_window = "rollout"), so the daemon's slots are idle meanwhile.
        with torch_threads(os.cpu_count() or 1):
            stats = [self.trainer.update(scored) for _ in range(cfg.passes)]
        self.push(step)
        update_s = time.perf_counter() - t0
        cpu.append(demo_cpu(self.daemon.proc.pid))
        window = windows(at_start, at_rollout_end, at_update, self.daemon.device_seconds())
        row = summarize(step, samples, finish, rollout_s, scored, stats[0].max_logprob_gap,
                        update_s, window)  # fmt: skip
        row = replace(
            row, epoch=self.dataset.epoch_of(step), shadow=shadow, law=law,
            shadow_version=in_service if self.shadow is not None else 0,
            measure_s=measure_s, update_tokens=stats[0].tokens,
            rollout_cpu=cpu[1] - cpu[0], update_cpu=cpu[3] - cpu[2],
        )  # fmt: skip
        self.rows.append(row)
        print_row(self.mode, row)
        return row

    def record_step(self, step: int, rollout_s: float, samples: int) -> None:
        """With --trace: the step's rollout (its job, wall-clock start, seconds; the machine's
        load average) beside the workers' traces, so that sim_rollout.py finds the engine
        passes of each RL step."""
        if self.daemon.trace_dir is None:
            return
        start = time.time() - rollout_s
        line = {"type": "step", "mode": self.mode, "step": step, "job": self.job_id,
                "start": start, "seconds": rollout_s, "samples": samples,
                "load": os.getloadavg()[0]}  # fmt: skip
        with (self.daemon.trace_dir / "demo.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")

    def push(self, step: int) -> None:
        """The new weights to the daemon: in-band over gRPC (no checkpoint on disk), or as a
        checkpoint directory through the HTTP door."""
        note = f"{self.mode} step {step + 1}"
        if self.daemon.http_url:
            ckpt = self.trainer.save(
                self.daemon.data_dir / f"ckpt-{self.mode}" / f"step-{step + 1}"
            )
            self.client.update_policy(ckpt, note=note)
        else:
            self.client.push_policy(self.trainer.model.state_dict(), note=note)

    def measure_law(self, samples: list[RolloutSample], prompts) -> TokenLaw:
        """Every output token of the samples with an even sample index (half the step's, chosen
        apart from their tokens: no selection) under the weights that sampled them, i.e. the
        trainer's before the step's update."""
        even = [s for s in samples if s.sample_index % 2 == 0]
        picked = [(prompts[s.prompt_index], s.token_ids) for s in even]
        with torch_threads(os.cpu_count() or 1):
            return token_law(self.trainer.model, picked, self.law_rng, self.trainer.pad_id)

    def measure_shadow(
        self, samples: list[RolloutSample], prompts, version: int
    ) -> tuple[float, float]:
        """Accepted length of drafter `version` (the one in service when the step's rollout
        began) and of the frozen initial one on the samples; version 1 is the frozen one."""
        if self.shadow is None:
            return (0.0, 0.0)
        weights = {k: v.detach() for k, v in self.trainer.model.state_dict().items()}
        return self.shadow.measure(weights, samples, prompts, self.drafter_path(version))

    def drafter_path(self, version: int) -> Path | None:
        """The checkpoint of learned drafter `version`; None for the initial one (<= 1)."""
        if version <= 1:
            return None
        return Path(self.client.raw.get_drafter(self.job_id, version).path)

    def close(self) -> None:
        self.client.close()


def windows(start, rollout_end, update_start, end) -> Window:
    """Device-seconds by state in the rollout window, the measurement gap and the update, from
    the daemon's per-state totals at their four bounds."""

    def delta(a, b, state):
        return b.get(state, 0.0) - a.get(state, 0.0)

    return Window(
        rollout_idle=delta(start, rollout_end, "idle"),
        rollout_training=delta(start, rollout_end, "training"),
        rollout_loading=delta(start, rollout_end, "loading"),
        update_idle=delta(update_start, end, "idle"),
        update_training=delta(update_start, end, "training"),
        gap_idle=delta(rollout_end, update_start, "idle"),
        gap_training=delta(rollout_end, update_start, "training"),
    )


def run_all(
    cfg: DemoConfig,
    daemon: Daemon,
    model: Path,
    work_dir: Path,
    drafter: Path | None = None,
    with_async: bool = True,
    curves: Curves | None = None,
) -> tuple[dict[str, list[StepRow]], dict[str, HeldOutScore], AsyncOutcome | None]:
    """Held-out score of the initial policy, then the TLT run, then the SD-off run, each
    followed by the held-out score of its final policy.

    Not interleaved step by step: the TLT job's drafter trains on devices its rollouts leave
    idle, and training only yields to rollout work of its own job's workers, so it would take
    devices from the other run's rollouts. Each run's job is cancelled when the run is over
    and the next starts once no device is training.
    """
    dataset = build_dataset(cfg.prompts, cfg.train_prompts, cfg.held_out_prompts, model_dir=model)
    scores = {"initial": evaluate(daemon, model, dataset, cfg, "initial policy", drafter)}
    print(f"\n{HEADER}", flush=True)
    results = {}
    for mode in MODES:
        run = Run(mode, cfg, daemon, dataset, model, drafter)
        try:
            run.warm_up()
            for step in range(cfg.steps):
                run.step(step)
                if curves is not None:  # after the step's timing: its wall time so far
                    seconds = sum(r.rollout_s + r.update_s for r in run.rows)
                    curves.of(mode).keep(step + 1, seconds, run.trainer.model)
            run.client.raw.cancel_job(run.job_id, "demo run finished")
            wait_until_no_training(run.client)
        finally:
            run.close()
        results[mode] = run.rows
        final = run.trainer.save(work_dir / f"final-{mode}")
        scores[mode] = evaluate(daemon, final, dataset, cfg, f"{mode} final policy", drafter)
    outcome = None
    if with_async:
        keep = None if curves is None else curves.of("async").keep
        outcome, trainer = run_async(cfg, daemon, dataset, model, drafter, keep)
        wait_until_no_training(RolloutClient(daemon.target))
        final = trainer.save(work_dir / "final-async")
        scores["async"] = evaluate(daemon, final, dataset, cfg, "async final policy", drafter)
    if curves is not None:
        score_curves(curves, cfg, daemon, dataset, model, work_dir, drafter)
    return results, scores, outcome


def score_curves(
    curves: Curves,
    cfg: DemoConfig,
    daemon: Daemon,
    dataset: TaskDataset,
    model: Path,
    work_dir: Path,
    drafter: Path | None,
) -> None:
    """Every kept policy's held-out reward (and the initial one's), at `CURVE_N` samples."""
    small = curve_config(cfg)
    print(f"\nheld-out curves ({CURVE_N} samples per prompt per point)", flush=True)

    def score_of(ckpt: Path, label: str) -> float:
        return evaluate(daemon, ckpt, dataset, small, label, drafter).mean

    curves.initial = score_of(model, "curve initial policy")
    curves.score(GRPOTrainer(model, lr=cfg.lr, seed=cfg.seed), work_dir, score_of)


def evaluate(
    daemon: Daemon,
    checkpoint: Path,
    dataset: TaskDataset,
    cfg: DemoConfig,
    label: str,
    drafter: Path | None = None,
) -> HeldOutScore:
    """The held-out score of a policy, rolled out by the daemon in a job of its own (drafter
    training off, every device) and cancelled afterwards. With `drafter` (the offline one,
    frozen) the job speculates: the accept rule gives a seeded sample the same law with SD on
    or off, and every policy is scored the same way, so the scores still pair up sample by
    sample, and the long held-out tail takes about half the time."""
    t0 = time.perf_counter()
    job_id = f"held-out-{label.replace(' ', '-')}"
    with RolloutClient(daemon.target) as client:
        client.create_job(
            checkpoint, job_id=job_id, speculative="auto" if drafter else "off",
            online_training=False, initial_drafter=drafter,
        )  # fmt: skip
        samples = client.generate(
            [ids for _, ids in dataset.held_out], n=cfg.held_out_n, temperature=1.0,
            max_new_tokens=cfg.max_new_tokens, stop_token_ids=[STOP_TOKEN_ID],
            seed=HELD_OUT_SAMPLING_SEED,
        )  # fmt: skip
        client.raw.cancel_job(job_id, "held-out score taken")
    out = score_samples(dataset.held_out, samples, load_tokenizer(checkpoint))
    print(
        f"  held out ({label}): reward {out.mean:.3f}, guesses {out.guess_share:.2f}, "
        f"mean length {out.mean_length:.0f} ({time.perf_counter() - t0:.0f}s)",
        flush=True,
    )
    return out


def wait_until_no_training(client: RolloutClient, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while any(d.state == "training" for d in client.raw.list_devices()):
        if time.monotonic() > deadline:
            print("  (drafter training still running; going on)", flush=True)
            return
        time.sleep(0.5)


def sd_share(samples: list[RolloutSample]) -> float:
    """Share of the samples' decode steps that verified a draft, counted per sample: a sample
    that had no draft inside a verify pass (e.g. no n-gram match) decoded a plain step there,
    and the first token (from the prefill) is no decode step (docs/sd-statistics.md). Not the
    share of engine passes that were verify passes, which counts such samples as speculating."""
    draft = sum(s.draft_steps for s in samples)
    plain = sum(s.plain_steps for s in samples)
    return draft / (draft + plain) if draft + plain else 0.0


def quantile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0


def tokens_digest(samples: list[RolloutSample]) -> str:
    """A digest of the samples' token ids in (prompt, sample) order: equal digests, the same
    samples."""
    h = hashlib.sha256()
    for s in sorted(samples, key=lambda s: (s.prompt_index, s.sample_index)):
        h.update(f"{s.prompt_index}:{s.sample_index}:{','.join(map(str, s.token_ids))};".encode())
    return h.hexdigest()[:16]


def summarize(step, samples, finish, rollout_s, scored, gap, update_s, window) -> StepRow:
    lengths = [s.num_tokens for s in samples]
    draft = sum(s.draft_steps for s in samples)
    accepted = sum(s.accepted_tokens for s in samples)
    mean = sum(s.reward for s in scored) / max(1, len(scored))
    return StepRow(
        step=step,
        epoch=0.0,
        rollout_s=rollout_s,
        tail_s=tail_seconds(finish),
        samples=len(samples),
        tokens=sum(lengths),
        p50=quantile(lengths, 0.5),
        p99=quantile(lengths, 0.99),
        max_len=max(lengths, default=0),
        capped=sum(s.finish_reason == "length" for s in samples) / max(1, len(samples)),
        sd_share=sd_share(samples),
        accepted_length=(accepted + draft) / draft if draft else 0.0,
        drafter_version=max((s.drafter_version for s in samples), default=0),
        drafter_versions=tuple(sorted({s.drafter_version for s in samples} - {0})),
        tokens_digest=tokens_digest(samples),
        policy_version=max((s.policy_version for s in samples), default=0),
        window=window,
        mean_reward=mean,
        reward_var=sum((s.reward - mean) ** 2 for s in scored) / max(1, len(scored)),
        update_s=update_s,
        logprob_gap=gap,
    )


def _initial_drafter(option: str | None, model: Path) -> Path | None:
    """--drafter, or the drafter fitted on the default policy when --model is that policy (a
    drafter fitted on another policy would be rejected by the daemon or useless)."""
    if option is None:
        default = model == MODEL.resolve() and (DRAFTER / "model.safetensors").exists()
        return DRAFTER.resolve() if default else None
    return None if option.lower() == "none" else Path(option).resolve()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 tiny steps per mode")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--prompts", type=int, help="prompts per step")
    parser.add_argument("--train-prompts", type=int, help="size of the training set")
    parser.add_argument("--held-out-prompts", type=int, help="size of the held-out set")
    parser.add_argument("--n", type=int, help="samples per prompt")
    parser.add_argument("--held-out-n", type=int, help="samples per held-out prompt")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--cpu-slots", type=int)
    parser.add_argument("--lr", type=float, help=f"the trainer's AdamW lr (default {DEMO_LR})")
    parser.add_argument(
        "--kl", type=float, help=f"KL penalty towards the initial policy (default {DEMO_KL})"
    )
    parser.add_argument(
        "--seed", type=int,
        help="sampling seeds of the training rollouts (seed * 1000 + step; default 0)",
    )  # fmt: skip
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument(
        "--drafter",
        help="offline-fitted EAGLE drafter the TLT run starts from (default: "
        f"{DRAFTER.relative_to(ROOT)} with the default --model, else none; 'none' = none)",
    )
    parser.add_argument("--work-dir", type=Path, help="keep checkpoints and the daemon's data")
    parser.add_argument("--plot", type=Path, help="write the curves to this PNG (matplotlib)")
    parser.add_argument(
        "--curves", type=Path,
        help="score each step's policy of every run on the held-out set and draw reward per "
        "step and per wall-clock second to this PNG (a few minutes more)",
    )  # fmt: skip
    parser.add_argument(
        "--http", action="store_true", help="roll out through the openai client (HTTP door)"
    )
    parser.add_argument("--no-async", action="store_true", help="skip the asynchronous TLT run")
    parser.add_argument(
        "--trace", type=Path,
        help="record every engine step of the daemon's workers and each RL step's rollout to "
        "this directory (replay: python benchmarks/sim_rollout.py validate DIR)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else DemoConfig()
    overrides = {"steps": args.steps, "prompts": args.prompts, "n": args.n,
                 "train_prompts": args.train_prompts, "held_out_prompts": args.held_out_prompts,
                 "held_out_n": args.held_out_n, "max_new_tokens": args.max_new_tokens,
                 "cpu_slots": args.cpu_slots, "lr": args.lr, "kl": args.kl,
                 "seed": args.seed}  # fmt: skip
    cfg = DemoConfig(**(vars(cfg) | {k: v for k, v in overrides.items() if v is not None}))
    model = args.model.resolve()
    if not (model / "config.json").exists():
        print(f"no policy at {model} (train it: python scripts/train_policy.py)", file=sys.stderr)
        return 1
    drafter = _initial_drafter(args.drafter, model)
    # The daemon's workers need cores while the trainer measures; the update takes them all.
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the demo prints its own progress
    random.seed(cfg.seed)
    with tempfile.TemporaryDirectory(prefix="tltd-grpo-") as tmp:
        work_dir = (args.work_dir or Path(tmp)).resolve()
        work_dir.mkdir(parents=True, exist_ok=True)
        print(f"starting tltd serve (SQLite, torch backend, {cfg.cpu_slots} CPU slots)", flush=True)
        trace = args.trace.resolve() if args.trace else None
        if trace is not None:
            trace.mkdir(parents=True, exist_ok=True)
            for old in trace.glob("*.jsonl"):  # a new recording, not appended to an old one
                old.unlink()
        daemon = Daemon(work_dir, cfg.cpu_slots, http=args.http, trace_dir=trace)

        def run() -> None:
            print(
                f"daemon at {daemon.target}; watch it with: TLTD_TARGET={daemon.target} "
                f"tltctl status   (metrics: http://127.0.0.1:{daemon.metrics_port}/metrics)"
            )
            print(
                f"{cfg.steps} GRPO steps per mode, {cfg.prompts} prompts x n={cfg.n}, "
                f"temperature 1, max {cfg.max_new_tokens} new tokens; training set "
                f"{cfg.train_prompts} prompts in shuffled epochs, held out "
                f"{cfg.held_out_prompts} x n={cfg.held_out_n} with fixed sampling seeds",
                flush=True,
            )
            with_async = not (args.no_async or args.http)
            curves = Curves() if args.curves else None
            results, scores, outcome = run_all(
                cfg, daemon, model, work_dir, drafter, with_async, curves
            )
            print_summary(results, scores)
            if outcome is not None:
                print_async_summary(outcome, results, scores)
            if args.plot:
                plot(results, scores, args.plot)
                print(f"curves: {args.plot}")
            if curves is not None:
                curves.plot(args.curves)
                print(f"held-out curves: {args.curves}")

        return run_then_stop(daemon, "demo", run)


def run_then_stop(daemon: Daemon, label: str, body: Callable[[], None]) -> int:
    """`body()`, then the daemon stopped by SIGTERM whatever happened: 0 when the body ran to
    its end and the daemon exited with 0. A daemon's error answer or Ctrl-C is printed, not
    raised, so the daemon is always stopped first."""
    code = 1
    try:
        body()
        code = 0
    except TltClientError as exc:
        print(f"\n{label} failed: the daemon answered {exc}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr, flush=True)
    finally:
        status = daemon.stop()
        print(f"tltd exited with status {status} after SIGTERM", flush=True)
    return code if status == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
