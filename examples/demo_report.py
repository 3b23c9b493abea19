"""The demo's record of each RL step and its report: the per-step table, the end-to-end
figures, the held-out scores, the drafter's shadow measurement and the harvest of idle devices,
and the curves as a PNG."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from examples.heldout import HeldOutScore, paired
from examples.sampling_law import TokenLaw, check

MODES = ("tlt", "off")  # TLT first: its drafter warms up while the baseline has nothing to warm
# TLT's GPU measurement: rollout is ~85% of an RL step without speculative decoding.
GPU_ROLLOUT_SHARE = 0.85


@dataclass(frozen=True)
class StepRow:
    step: int
    epoch: float  # epochs of the training set covered when the step starts
    rollout_s: float
    tail_s: float  # from 90% of samples finished to the last
    samples: int
    tokens: int
    p50: int  # answer length quantiles (tokens)
    p99: int
    max_len: int
    capped: float  # share of samples stopped by max_new_tokens
    sd_share: float  # share of the samples' decode steps that verified a draft (sd_share())
    accepted_length: float  # tokens per SD step (accepted + 1); 0 without SD
    drafter_version: int  # the newest EAGLE version that drafted any of the step's samples
    policy_version: int
    window: Window  # device-seconds by state in the rollout window, the gap and the update
    mean_reward: float
    reward_var: float  # variance of the step's per-sample rewards (for reward_trend)
    update_s: float
    logprob_gap: float
    shadow: tuple[float, float] = (0.0, 0.0)  # accepted length: drafter used, frozen initial
    # The drafter version the shadow scored as "used": the one in service when the step's
    # rollout began (promoted before any of its samples existed); 1 = the frozen one itself.
    shadow_version: int = 0
    # Every EAGLE version that drafted one of the step's samples (each sample: the last).
    drafter_versions: tuple[int, ...] = ()
    # Wall time of the measurements between rollout and update (shadow, sampling law): not in
    # the step's time, shown apart.
    measure_s: float = 0.0
    update_tokens: int = 0  # output tokens the logprob gap covers (the update's samples)
    # CPU seconds of the daemon's processes and the trainer's during the rollout and the update
    # (examples/cpu_time.py): the step's necessary work, whatever waited on what.
    rollout_cpu: float = 0.0
    update_cpu: float = 0.0
    tokens_digest: str = ""  # of the step's samples' token ids, in (prompt, sample) order
    # The law's tokens: those of the samples with an even sample index (examples/sampling_law.py).
    law: TokenLaw = field(default_factory=TokenLaw, repr=False)

    @property
    def step_s(self) -> float:
        return self.rollout_s + self.update_s

    @property
    def rollout_share(self) -> float:
        return self.rollout_s / self.step_s if self.step_s else 0.0


@dataclass(frozen=True)
class Window:
    """Device-seconds (summed over devices) spent idle and training during the step's rollout
    window (request sent -> last sample), the measurement gap after it (shadow, sampling law)
    and its update (push included). A device is idle from the moment it runs no rollout work;
    the idle grace only delays when training may start on it."""

    rollout_idle: float = 0.0
    rollout_training: float = 0.0
    update_idle: float = 0.0
    update_training: float = 0.0
    # Of the training device-seconds: those its trainer spent starting up (held, not training).
    rollout_loading: float = 0.0
    gap_idle: float = 0.0
    gap_training: float = 0.0

    @property
    def outside_training(self) -> float:
        """Device-seconds of drafter training after the rollout: the gap and the update."""
        return self.gap_training + self.update_training

    @property
    def rollout_trained(self) -> float:
        """Device-seconds of the rollout window in which drafter training ran."""
        return self.rollout_training - self.rollout_loading

    @property
    def harvested(self) -> float:
        """Share of the rollout window's idle device-seconds that drafter training used (a
        training device has no rollout work: it would be idle otherwise). A trainer's start
        (spawn to ready) is not counted as training."""
        free = self.rollout_idle + self.rollout_training
        return self.rollout_trained / free if free else 0.0


def reward_trend(rows: list[StepRow]) -> tuple[float, float]:
    """Least-squares slope of the per-sample reward against the step index, and its standard
    error: a slope several standard errors above 0 is a trend, not sampling noise. Computed from
    each step's sample count, mean and variance (the per-sample regression, exactly)."""
    n = sum(r.samples for r in rows)
    if len(rows) < 2 or n < 3:
        return float("nan"), float("nan")
    x_bar = sum(r.samples * r.step for r in rows) / n
    y_bar = sum(r.samples * r.mean_reward for r in rows) / n
    sxx = sum(r.samples * (r.step - x_bar) ** 2 for r in rows)
    slope = sum(r.samples * (r.step - x_bar) * (r.mean_reward - y_bar) for r in rows) / sxx
    fit = {r.step: y_bar + slope * (r.step - x_bar) for r in rows}
    # Residuals of every sample: its step's spread around the step mean, plus the mean's miss.
    sse = sum(r.samples * (r.reward_var + (r.mean_reward - fit[r.step]) ** 2) for r in rows)
    return slope, (sse / (n - 2) / sxx) ** 0.5


# ---- the table ------------------------------------------------------------------------------

HEADER = (
    f"{'mode':<5}{'step':>5}{'epoch':>6}{'rollout s':>10}{'update s':>9}{'step s':>8}"
    f"{'share':>6}{'tail s':>7}{'tokens':>7}{'p50':>5}{'p99':>5}{'capped':>7}{'SD':>5}"
    f"{'acc':>5}{'shv':>4}{'used':>6}{'frozen':>7}{'drafter':>8}{'policy':>7}{'harvest':>8}"
    f"{'meas s':>7}{'trn out':>8}{'reward':>7}"
)


def used_column(r: StepRow) -> str:
    """The shadow's "used" figure; "same" where the drafter in service was the frozen initial
    one (version 1): equal to `frozen` by construction, not measured against it."""
    return "same" if r.shadow_version == 1 else f"{r.shadow[0]:.2f}"


def print_row(mode: str, r: StepRow) -> None:
    print(
        f"{mode:<5}{r.step:>5}{r.epoch:>6.1f}{r.rollout_s:>10.2f}{r.update_s:>9.2f}"
        f"{r.step_s:>8.2f}{100 * r.rollout_share:>5.0f}%{r.tail_s:>7.2f}{r.tokens:>7}"
        f"{r.p50:>5}{r.p99:>5}{100 * r.capped:>6.1f}%{r.sd_share:>5.2f}"
        f"{r.accepted_length:>5.2f}{r.shadow_version:>4}{used_column(r):>6}{r.shadow[1]:>7.2f}"
        f"{r.drafter_version:>8}{r.policy_version:>7}{100 * r.window.harvested:>7.0f}%"
        f"{r.measure_s:>7.2f}{r.window.outside_training:>8.1f}{r.mean_reward:>7.2f}",
        flush=True,
    )


# ---- the summary ----------------------------------------------------------------------------


def projected_speedup(rollout_speedup: float, rollout_share: float = GPU_ROLLOUT_SHARE) -> float:
    """End-to-end step speedup when rollout is `rollout_share` of the baseline step and only
    the rollout gets faster (Amdahl)."""
    return 1.0 / ((1.0 - rollout_share) + rollout_share / rollout_speedup)


def _se_ratio(value: float, se: float) -> float:
    return value / se if se else math.nan


def print_timing(results: dict[str, list[StepRow]]) -> tuple[float, float]:
    tot = {m: (sum(r.rollout_s for r in results[m]), sum(r.step_s for r in results[m]))
           for m in MODES}  # fmt: skip
    (tlt_r, tlt_s), (off_r, off_s) = tot["tlt"], tot["off"]
    rollout_x = off_r / tlt_r if tlt_r else math.nan
    step_x = off_s / tlt_s if tlt_s else math.nan
    share = off_r / off_s if off_s else math.nan
    print(
        f"\nrollout time: TLT {tlt_r:.2f}s vs SD off {off_r:.2f}s -> rollout speedup "
        f"{rollout_x:.2f}x (TLT / off = {tlt_r / off_r if off_r else math.nan:.2f})"
    )
    later = {m: sum(r.rollout_s for r in results[m] if r.epoch >= 1.0) for m in MODES}
    if later["tlt"] and later["off"]:
        # From the second epoch on, a prompt's earlier answers are in the history drafter.
        print(
            f"rollout time from the second epoch on: TLT {later['tlt']:.2f}s vs SD off "
            f"{later['off']:.2f}s -> rollout speedup {later['off'] / later['tlt']:.2f}x"
        )
    print(
        f"step time (rollout + update): TLT {tlt_s:.2f}s vs SD off {off_s:.2f}s -> "
        f"end-to-end step speedup {step_x:.2f}x (measured; rollout {100 * share:.0f}% of "
        f"the SD-off step here)"
    )
    print(f"projection, not a measurement: with rollout {100 * GPU_ROLLOUT_SHARE:.0f}% of the "
          f"SD-off step (TLT's GPU figure) this rollout speedup gives "
          f"{projected_speedup(rollout_x):.2f}x end to end")  # fmt: skip
    print_noise(results)
    return rollout_x, step_x


def same_samples(results: dict[str, list[StepRow]]) -> bool:
    """Whether both runs' steps sampled the same tokens (every step's digest equal)."""
    tlt, off = results.get("tlt", []), results.get("off", [])
    return bool(tlt) and [r.tokens_digest for r in tlt] == [r.tokens_digest for r in off]


def print_noise(results: dict[str, list[StepRow]]) -> None:
    """The measurement gap (outside the step times) and a single run's timing noise: with the
    same samples both runs' updates do the same arithmetic, so their time difference is noise."""
    meas = {m: sum(r.measure_s for r in results[m]) for m in MODES}
    print(f"measurements between rollout and update (shadow, sampling law; not in the step "
          f"times): TLT {meas['tlt']:.1f}s, off {meas['off']:.1f}s")  # fmt: skip
    upd = {m: sum(r.update_s for r in results[m]) for m in MODES}
    what = ("the same samples, so the same arithmetic" if same_samples(results)
            else "different samples")  # fmt: skip
    diff = 100 * (upd["tlt"] / upd["off"] - 1) if upd["off"] else math.nan
    print(f"one run per mode, TLT first (not alternated): the updates ({what}) took TLT "
          f"{upd['tlt']:.2f}s vs off {upd['off']:.2f}s ({diff:+.1f}%); a single run's timings "
          f"carry noise of that order (docs/demo.md gives medians of 3 runs)")  # fmt: skip


def print_held_out(scores: dict[str, HeldOutScore]) -> None:
    first = scores["initial"]
    print(
        f"held-out reward (fixed sampling seeds, paired; standard errors over the "
        f"{len(set(first.prompts))} prompts' mean differences): initial {first.mean:.3f} "
        f"(guesses {first.guess_share:.2f}, mean length {first.mean_length:.0f})"
    )
    for mode in MODES:
        if mode not in scores:
            continue
        s = scores[mode]
        delta, se = paired(first.rewards, s.rewards, first.prompts or None)
        print(f"  {mode}: {s.mean:.3f} (guesses {s.guess_share:.2f}, mean length "
              f"{s.mean_length:.0f}), change {delta:+.3f} +- {se:.3f} "
              f"({_se_ratio(delta, se):+.1f} standard errors)")  # fmt: skip
    if all(m in scores for m in MODES):
        if scores["off"].rewards == scores["tlt"].rewards:
            # Seeded samples are the same with SD on and off (docs/sd-statistics.md): two runs
            # whose updates never parted end on the same policy and score alike.
            print("  TLT - off at the end: 0 (the same reward on every held-out sample)")
            return
        delta, se = paired(scores["off"].rewards, scores["tlt"].rewards, first.prompts or None)
        print(
            f"  TLT - off at the end: {delta:+.3f} +- {se:.3f} "
            f"({_se_ratio(delta, se):+.1f} standard errors)"
        )


def print_drafter(rows: list[StepRow]) -> None:
    measured = [r for r in rows if r.shadow[1] > 0]
    if not measured:
        return
    used = [used_column(r) for r in measured]
    frozen = [round(r.shadow[1], 2) for r in measured]
    print(f"shadow accepted length (k=4, 16 of the step's own samples) of the drafter in service "
          f"when the step's rollout began (promoted before it, so never trained on the samples "
          f"it is scored on), and of the frozen initial drafter: used {used}, frozen {frozen} "
          f"('same': version 1, the frozen drafter itself, in service: equal by construction, "
          f"not a measurement)")  # fmt: skip
    learned = [r for r in measured if r.shadow_version > 1]
    if learned:
        last = learned[-1]
        print(
            f"  last step with a learned version in service: step {last.step}, version "
            f"{last.shadow_version}, used / frozen {last.shadow[0] / last.shadow[1]:.2f}x"
        )
    else:
        print("  no learned version was in service when a step began: nothing compared")
    print(f"EAGLE drafter versions that drafted the samples, per step (a sample's last): "
          f"{[list(r.drafter_versions) for r in rows]}")  # fmt: skip


def print_harvest(rows: list[StepRow]) -> None:
    if not rows:
        return
    idle = sum(r.window.rollout_idle + r.window.rollout_training for r in rows)
    used = sum(r.window.rollout_trained for r in rows)
    loading = sum(r.window.rollout_loading for r in rows)
    gap = sum(r.window.gap_training for r in rows)
    upd = sum(r.window.update_training for r in rows)
    per_step = [f"{100 * r.window.harvested:.0f}%" for r in rows]
    print(f"idle device-seconds in rollout windows (idle from the moment a device runs no "
          f"rollout work, the idle grace before training may start included) used by drafter "
          f"training: {per_step}, total {used:.1f} of {idle:.1f} "
          f"({100 * used / idle if idle else 0.0:.0f}%; trainer start-up, not counted: "
          f"{loading:.1f}); training after the rollouts {gap + upd:.1f} device-s (measurement "
          f"gap {gap:.1f}, updates {upd:.1f})")  # fmt: skip


def print_sampling_law(results: dict[str, list[StepRow]]) -> None:
    """Whether each run's tokens follow the law of the weights that sampled them
    (examples/sampling_law.py): the KS test of their randomized PITs against U(0, 1) and the
    surprise score; under the law both p-values are U(0, 1)."""
    parts = []
    for mode in MODES:
        law = TokenLaw()
        for row in results.get(mode, []):
            law += row.law
        c = check(law)
        total = sum(r.tokens for r in results.get(mode, []))
        if c.tokens:
            parts.append(f"{mode} {c.tokens} of {total} tokens: KS {c.ks:.4f} "
                         f"(p {c.ks_pvalue:.2f}), surprise z {c.z:+.2f} "
                         f"(p {c.z_pvalue:.2f})")  # fmt: skip
    if not parts:
        return
    print("sampling law, every output token of the samples with an even sample index (half of "
          "each prompt's, chosen apart from their tokens) under the weights that sampled it: "
          + "; ".join(parts))  # fmt: skip
    if same_samples(results):
        print(
            "  TLT and SD off sampled the same tokens: the two lines are one check of the "
            "daemon's sampling, not a separate check of speculative decoding"
        )


def print_logprob_gap(results: dict[str, list[StepRow]]) -> None:
    rows = [r for mode in MODES for r in results.get(mode, [])]
    gap = max((r.logprob_gap for r in rows), default=0.0)
    covered, total = sum(r.update_tokens for r in rows), sum(r.tokens for r in rows)
    print(f"max |trainer logprob - daemon logprob| over the tokens the updates trained on "
          f"(samples with a non-zero advantage, each step's first pass; {covered} of {total} "
          f"rollout tokens): {gap:.2e}")  # fmt: skip


def print_summary(results: dict[str, list[StepRow]], scores: dict[str, HeldOutScore]) -> float:
    print("\n" + HEADER)
    for mode in MODES:
        for row in results.get(mode, []):
            print_row(mode, row)
    rollout_x, _ = print_timing(results)
    print_held_out(scores)
    rewards = {m: [round(r.mean_reward, 2) for r in results[m]] for m in MODES}
    print(f"mean training reward per step: TLT {rewards['tlt']}  off {rewards['off']}")
    for mode in MODES:
        slope, se = reward_trend(results[mode])
        if slope == slope:  # not NaN: at least two steps
            print(f"training reward trend ({mode}): {slope:+.3f} per step, standard error "
                  f"{se:.3f} ({_se_ratio(slope, se):+.1f} standard errors)")  # fmt: skip
    for mode in MODES:
        rows = results[mode]
        print(f"answer lengths ({mode}, per step): p50 {[r.p50 for r in rows]}, p99 "
              f"{[r.p99 for r in rows]}, tokens {[r.tokens for r in rows]}")  # fmt: skip
    print_drafter(results["tlt"])
    print_harvest(results["tlt"])
    print_logprob_gap(results)
    print_sampling_law(results)
    return rollout_x


def plot(results: dict[str, list[StepRow]], scores: dict[str, HeldOutScore], path: Path) -> None:
    """Training reward per step with the held-out reward before/after, and the shadow accepted
    lengths per step (used vs frozen initial drafter), as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, color in zip(MODES, ("tab:blue", "tab:orange"), strict=True):
        rows = results[mode]
        ax1.plot([r.step for r in rows], [r.mean_reward for r in rows], "o-", color=color,
                 label=f"{mode}: training batch")  # fmt: skip
        if mode in scores:
            ax1.plot([0, len(rows)], [scores["initial"].mean, scores[mode].mean], "s--",
                     color=color, label=f"{mode}: held out (before, after)")  # fmt: skip
    ax1.set_xlabel("RL step (held out: before step 0, after the last)")
    ax1.set_ylabel("mean reward")
    ax1.legend(fontsize=8)
    rows = [r for r in results["tlt"] if r.shadow[1] > 0]
    learned = [r for r in rows if r.shadow_version > 1]  # "used" is the frozen one elsewhere
    ax2.plot([r.step for r in learned], [r.shadow[0] for r in learned], "o-",
             label="learned drafter in service at the step's start")  # fmt: skip
    ax2.plot([r.step for r in rows], [r.shadow[1] for r in rows], "s--", label="frozen initial")
    ax2.set_xlabel("RL step (TLT run)")
    ax2.set_ylabel("accepted length, k=4 (shadow)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
