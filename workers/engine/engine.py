"""The rollout engine: continuous batching over a KV cache with adaptive lossless speculation.

Public API (used by the rollout worker and the drafter trainer)::

    engine = Engine(model_or_path, EngineConfig(max_batch=64, max_seq_len=2048))
    engine.add_request(request_id, prompt_ids, SamplingParams(n=8, temperature=1.0, seed=1),
                       prompt_index=0, return_hidden_states=False, speculative=True)
    while engine.has_work():
        for out in engine.step():   # one schedule -> execute -> record iteration
            ...                      # SampleOutput of every sample that finished in that step
    engine.generate([Request(...), ...]) -> list[SampleOutput]   # run to completion
    engine.cancel(request_id)        # its samples finish as CANCELLED (returned by next step())
    engine.abort_all()               # every sample CANCELLED now; returns their outputs
    engine.load() -> EngineLoad      # samples held, tokens they may still generate
    engine.set_drafter(EagleDrafter | None, version)   # hot swap between steps
    engine.load_policy(path_or_hf_state_dict, version) # new target weights between steps
    engine.stats -> EngineStats      # engine.strategy_snapshot() -> per-bucket arms + "plain"
    engine.gate_snapshot()           # cost model, acceptance, predicted vs measured gain
    Engine(..., costs=CostModel, gate_state=GateState)  # reuse what another engine measured
    # EngineConfig, Request, SampleOutput live in tltd_workers.engine.datatypes (re-exported here)
    EngineConfig.from_speculative(job.speculative, max_batch=...)  # a job's config -> engine's
    SampleOutput.to_domain() -> tltd.domain.Sample

Semantics:
- A request is one prompt with `sampling.n` samples; its prompt is prefilled once and the KV
  copied into the n slots. Requests wait FIFO and join the running batch at a step boundary
  when all n samples fit; finished samples leave at once (the last running row moves into the
  freed slot so that the batch stays compacted in slots [0, B)).
- token_ids include the stop token that ended a sample (finish STOP); LENGTH when
  max_new_tokens (or max_seq_len) is reached; CANCELLED keeps the tokens emitted so far.
- logprobs[i] is log p(token_i) under the *processed* target distribution (sampling.py):
  log_softmax(restrict(logits / T)) for T > 0, log_softmax(logits) for greedy rows; with
  sampling.logprob_mode "raw", log_softmax(logits) for every row (sampling is unchanged).
  With speculation they are still the target's (computed in the verify pass).
- Per-row SD counters (SampleOutput, EngineStats): a row without drafts in a verify pass
  decoded a plain step. The first token of every sample is drawn from its prompt's prefill,
  never in a decode step. sampling.return_provenance adds, per token, whether it was a plain
  draw, an accepted draft, a residual draw after a rejection or a bonus token, with the
  drafter and draft length of its step (docs/sd-statistics.md).
- Randomness is counter-based per (seed, prompt_index, sample_index, position): a seeded
  sample is the same whatever else is in the batch, for a fixed speculative mode and
  strategy (spec "off", or "fixed" while the batch stays <= batch_threshold; "adaptive" picks
  strategies from timings, so its sampled outputs are equal in distribution but not bitwise
  reproducible). Greedy output is the same in every mode. Requests without a seed get one
  from EngineConfig.seed and their arrival order. The n-gram drafter's corpus is the samples
  added together (one add_request), so a slice of a prompt's samples run on its own (a
  retry) reproduces its seeded tokens with SD off or EAGLE drafts, but with n-gram drafts
  only in distribution.
- Speculation: each decode step of the adaptive mode runs the arm the bandit picks for the
  running batch's bucket: a strategy (drafter, k) or, with gate "measured", plain decoding.
  That gate starts each bucket from a cost model timed on the device at start (costs.py:
  plain / verify / draft ms per bucket) combined with the acceptance observed per drafter
  (gate.py), so it speculates exactly in the buckets where that is predicted and then
  measured to pay, at any batch size. Gate "threshold" (and the "fixed" mode, always
  strategies[0]) speculates while the batch is <= batch_threshold. An SD step verifies every
  row's drafts in one target forward and keeps what the rule in spec.py accepts; rejected
  positions are dropped by shortening the slot's length (target and EAGLE caches). Rows of
  requests with speculative=False decode one token per step.
  While an EAGLE drafter is set the engine keeps each sample's hidden states (positions x
  hidden floats per sample) so that a hot-swapped drafter can catch up.
- What the gate learned (rewards, acceptance) is `gate_state`: it lives as long as the
  engine and can be handed to the next engine of the same job; gate.GateState states when
  a new policy or drafter version drops parts of it.
- hidden_states (return_hidden_states=True): the target's final-norm hidden state at every
  position fed to it, [len(prompt) + len(token_ids) - 1, H] (the last token is never fed).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from tltd.domain import (
    FinishReason,
    LogprobMode,
    PromptLogprobs,
    SamplingParams,
    TokenProvenance,
    TopLogprobs,
)
from tltd_workers.engine.bandit import (
    BucketedEpsilonGreedy,
    FixedStrategy,
    NoStrategyAvailable,
    Strategy,
)
from tltd_workers.engine.costs import CostModel, arm_rewards, measure_costs
from tltd_workers.engine.datatypes import EngineConfig, EngineLoad, Request, SampleOutput
from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.engine.gate import GateState, verdicts
from tltd_workers.engine.history import HistoryDrafter
from tltd_workers.engine.kv_cache import KVCache
from tltd_workers.engine.ngram import NgramDrafter
from tltd_workers.engine.sampling import (
    ACCEPT,
    DRAFT,
    SAMPLE,
    RowParams,
    log_probs,
    returned_logprobs,
    row_key,
    sample_from,
    token_logprobs,
    uniforms,
)
from tltd_workers.engine.spec import accept_drafts
from tltd_workers.engine.stats import PLAIN_TOKEN, EngineStats, step_provenance
from tltd_workers.engine.transformer import (
    Batch,
    CausalLM,
    ModelConfig,
    load_model,
    load_weights,
    read_state_dict,
)

# An EAGLE step whose rows have more than this many drafts' worth ((k + 1) positions each) of
# positions the drafter has not seen catches up on them first (Engine._eagle_drafts).
CATCH_UP_BACKLOG = 2
# The history arm drafts a row from its prompt's history where the history offers at least
# this many tokens (a shorter walk means a rare or contested continuation) and from the EAGLE
# drafter elsewhere, in the same verify pass. The choice is a function of the row's context
# (history drafts are deterministic), not of any draw, so each row keeps its proposal law.
HISTORY_MIN_DRAFT = 4


@dataclass
class _Group:
    """One prompt of a request and its n samples."""

    request_id: str
    prompt_index: int
    prompt: list[int]
    sampling: SamplingParams
    seed: int
    return_hidden: bool
    speculative: bool
    policy_version: int
    group_key: str = ""
    live: int = 0
    sample_offset: int = 0  # sample indices of this group are offset .. offset + n - 1
    # Earlier answers to this prompt (sample id, tokens), for the history drafter at admission.
    past: Sequence[tuple[Hashable, Sequence[int]]] = ()
    history_key: tuple[int, ...] = ()
    prompt_lp: PromptLogprobs | None = None  # set at prefill when sampling.prompt_logprobs is


class _Seq:
    """A running sample: its emitted tokens and the bookkeeping of its cache rows."""

    __slots__ = (
        "group",
        "index",
        "key",
        "tokens",
        "logprobs",
        "stop",
        "max_new",
        "draft_steps",
        "plain_steps",
        "accepted",
        "drafted",
        "bonus",
        "residual",
        "provenance",
        "drafter_version",
        "history",
        "eagle_hidden",
        "eagle_tokens",
        "eagle_ok",
        "spans",
        "answer_id",
        "top",
    )

    def __init__(self, group: _Group, index: int, key: int, max_new: int) -> None:
        self.group = group
        self.index = index
        self.key = key
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.stop = frozenset(group.sampling.stop_token_ids)
        self.max_new = max_new
        self.draft_steps = self.plain_steps = self.accepted = self.drafter_version = 0
        self.drafted = self.bonus = self.residual = 0
        self.provenance: list[TokenProvenance] | None = (
            [] if group.sampling.return_provenance else None
        )
        self.history: list[Tensor] | None = [] if group.return_hidden else None
        self.eagle_hidden: list[Tensor] = []  # hidden states the EAGLE drafter has not consumed
        self.eagle_tokens: list[int] = []  # ... and the token that followed each
        self.eagle_ok = False
        # (first token index, policy version): a version loaded while it runs opens a span.
        self.spans: list[tuple[int, int]] = [(0, group.policy_version)]
        self.answer_id = -1  # its answer in the history drafter (-1: not indexed there)
        # Per emitted token its top alternatives, when the request asked for them.
        self.top: list[TopLogprobs] | None = [] if group.sampling.top_logprobs > 0 else None

    @property
    def sample_key(self) -> str:
        return str(self.index)


class Engine:
    """Continuous-batching rollout engine (module docstring)."""

    def __init__(
        self,
        model_or_path: CausalLM | str | Path,
        config: EngineConfig | None = None,
        *,
        costs: CostModel | None = None,
        gate_state: GateState | None = None,
    ):
        """`costs`: a cost model measured by an earlier engine, used when it fits this one (same
        architecture, dtype, device, threads, context and buckets; a model without a key is
        taken as made for this engine), else measured again (cost_budget_s > 0);
        `gate_state`: what an earlier engine of the same job learned, continued when it fits
        (same strategies and buckets)."""
        # Long on purpose: the engine's state is declared in one place, in start order.
        self.config = cfg = config or EngineConfig()
        if cfg.spec_mode not in ("off", "adaptive", "fixed"):
            raise ValueError(f"spec_mode must be off|adaptive|fixed, got {cfg.spec_mode!r}")
        if cfg.gate not in ("measured", "threshold"):
            raise ValueError(f"gate must be measured|threshold, got {cfg.gate!r}")
        if isinstance(model_or_path, CausalLM):
            self.model = model_or_path.to(dtype=cfg.dtype, device=cfg.device).eval()
        else:
            self.model = load_model(model_or_path, cfg.dtype, cfg.device)
        self.device = torch.device(cfg.device)
        self.cache = self.model.new_cache(cfg.max_batch, cfg.max_seq_len)
        self.running: list[_Seq] = []  # running[i] lives in cache slot i
        self.waiting: deque[_Group] = deque()
        self.ngram = NgramDrafter(cfg.ngram_max_match, cfg.ngram_min_match)
        # Indexing every emitted token costs Python time: only when n-grams may be proposed.
        self._ngram_on = cfg.spec_mode != "off" and any(
            st.drafter == "ngram" for st in cfg.strategies
        )
        # Tokens emitted this step, indexed at the step's end in (group, sample index) order:
        # the index keeps the last occurrence of an n-gram, and slot order depends on what
        # else is in the batch, so indexing in slot order would let other requests change a
        # seeded sample's drafts and thereby its tokens.
        self._ngram_pending: list[tuple[str, int, str, list[int]]] = []
        # Answers of earlier samples per prompt (history.py); indexed like the n-grams.
        self.history: HistoryDrafter | None = None
        if cfg.spec_mode != "off" and any(st.drafter == "history" for st in cfg.strategies):
            self.history = HistoryDrafter(cfg.history_max_tokens, cfg.history_max_prompt_tokens)
        self._history_pending: list[tuple[str, int, _Seq, list[int]]] = []
        # Draft length of EAGLE rows in a history step: the longest EAGLE arm (0: no fallback).
        self._eagle_k = max((st.k for st in cfg.strategies if st.drafter == "eagle"), default=0)
        self.drafter: EagleDrafter | None = None
        self.drafter_version = 0
        self.eagle_cache: KVCache | None = None
        self.policy_version = 0
        self.stats = EngineStats()
        # The measured gate: plain decoding is an arm, priors come from the cost model.
        self._measured = cfg.spec_mode == "adaptive" and cfg.gate == "measured"
        self.gate_state: GateState | None = None
        self.costs: CostModel | None = None
        if cfg.spec_mode == "fixed":
            self.bandit: BucketedEpsilonGreedy | FixedStrategy = FixedStrategy(cfg.strategies[0])
        else:
            buckets = cfg.bucket_sizes()
            if gate_state is None or not gate_state.fits(cfg.strategies, buckets, self._measured):
                gate_state = GateState(
                    BucketedEpsilonGreedy(
                        cfg.strategies,
                        buckets,
                        cfg.epsilon,
                        cfg.window,
                        cfg.seed,
                        plain_arm=self._measured,
                        explore_margin=cfg.explore_margin,
                    )
                )
            self.gate_state = gate_state
            self.bandit = gate_state.bandit
            if self._measured:
                self.costs = self._cost_model(costs)
        self.prefills = 0  # prefill forwards run (one per prompt, shared by its n samples)
        self._outputs: list[SampleOutput] = []  # finished outside step() (cancel)
        self._catch_up_s = 0.0  # drafter catch-up time of the current SD step
        self._next_seed = cfg.seed
        self._groups_added = 0

    def _cost_model(self, earlier: CostModel | None) -> CostModel | None:
        """`earlier` if it was measured for this engine's shape, else a fresh measurement
        (None with cost_budget_s 0)."""
        cfg = self.config
        buckets = cfg.bucket_sizes()
        context = min(cfg.cost_context, cfg.max_seq_len)
        key = (
            self.model.config,
            str(cfg.dtype),
            cfg.device,
            torch.get_num_threads(),
            context,
            buckets,
        )
        if earlier is not None and earlier.key in (None, key):  # None: made for this engine
            return earlier
        if cfg.cost_budget_s <= 0:
            return None
        ks = [st.k for st in cfg.strategies]
        return measure_costs(
            self.model, self.cache, buckets, ks, context, cfg.cost_budget_s, key=key
        )

    # -- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        prompt_index: int = 0,
        return_hidden_states: bool = False,
        speculative: bool = True,
        sample_offset: int = 0,
        history: Sequence[tuple[Hashable, Sequence[int]]] = (),
    ) -> None:
        """Queue one prompt with sampling.n samples; it joins the batch at a step boundary.

        `sample_offset` numbers the samples offset .. offset + n - 1 (their index and their
        randomness key), so that a worker can run any contiguous slice of a prompt's samples and
        a retried slice reproduces the same tokens (n-gram drafts: see the module docstring).
        `history`: earlier answers to this prompt (a sample id and its tokens each, oldest
        first, e.g. read from the store) that the history drafter adds when the prompt is
        admitted, unless it holds them already.
        """
        # Long on purpose: the request's checks and its group are built in one pass.
        prompt = [int(t) for t in prompt_ids]
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ValueError("prompt_ids is empty")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt_ids must be in [0, {vocab})")
        if len(prompt) >= self.config.max_seq_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens >= max_seq_len {self.config.max_seq_len}"
            )
        if not 1 <= sampling.n <= self.config.max_batch:
            raise ValueError(f"sampling.n must be in [1, max_batch={self.config.max_batch}]")
        if sampling.max_new_tokens < 1:
            raise ValueError("sampling.max_new_tokens must be >= 1")
        if not 0.0 < sampling.top_p <= 1.0 or sampling.top_k < 0 or sampling.temperature < 0:
            raise ValueError("need 0 < top_p <= 1, top_k >= 0, temperature >= 0")
        if sample_offset < 0:
            raise ValueError("sample_offset must be >= 0")
        wanted = set(range(sample_offset, sample_offset + sampling.n))
        if dup := wanted & self._live_samples(request_id, prompt_index):
            raise ValueError(
                f"request {request_id!r} prompt {prompt_index}: samples {sorted(dup)} are "
                "already queued"
            )
        # Unique per add: a sample that finished may run again (a retry) while its siblings,
        # added with it, still run under the old group.
        group_key = f"{request_id}\x00{prompt_index}\x00{sample_offset}\x00{self._groups_added}"
        self._groups_added += 1
        seed = sampling.seed
        if seed is None:
            seed, self._next_seed = self._next_seed, self._next_seed + 1_000_003
        group = _Group(
            request_id,
            prompt_index,
            prompt,
            sampling,
            seed,
            return_hidden_states,
            speculative,
            self.policy_version,
            group_key,
            sample_offset=sample_offset,
            past=history,
        )
        self.waiting.append(group)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._outputs)

    def _live_samples(self, request_id: str, prompt_index: int) -> set[int]:
        """Sample indices of this prompt that are waiting or running."""
        live = {
            s.index
            for s in self.running
            if s.group.request_id == request_id and s.group.prompt_index == prompt_index
        }
        for g in self.waiting:
            if g.request_id == request_id and g.prompt_index == prompt_index:
                live.update(range(g.sample_offset, g.sample_offset + g.sampling.n))
        return live

    def cancel(self, request_id: str) -> None:
        """Finish every sample of the request as CANCELLED (reported by the next step())."""
        for g in [g for g in self.waiting if g.request_id == request_id]:
            self.waiting.remove(g)
            for i in range(g.sampling.n):
                self._outputs.append(
                    SampleOutput(
                        request_id,
                        g.prompt_index,
                        g.sample_offset + i,
                        [],
                        [],
                        FinishReason.CANCELLED,
                        g.policy_version,
                        top_logprobs=[] if g.sampling.top_logprobs > 0 else None,
                    )
                )
        done = {
            i: FinishReason.CANCELLED
            for i, s in enumerate(self.running)
            if s.group.request_id == request_id
        }
        self._outputs.extend(self._finish(done))

    def abort_all(self) -> list[SampleOutput]:
        """Cancel every request, waiting or running; returns their outputs (CANCELLED, with the
        tokens so far). Nothing is left afterwards."""
        running = {s.group.request_id for s in self.running}
        for request_id in running | {g.request_id for g in self.waiting}:
            self.cancel(request_id)
        return self.step()

    def load(self) -> EngineLoad:
        """What the engine holds: samples waiting or running, and the tokens they are predicted
        to still generate: per sample its prompt's mean answer length in the history drafter
        less what it emitted (at least 1, at most its `max_new_tokens` left), or its
        `max_new_tokens` left for a prompt without finished answers there."""
        samples = len(self.running) + sum(g.sampling.n for g in self.waiting)
        tokens = sum(self._predicted_left(s.group, len(s.tokens)) for s in self.running)
        tokens += sum(g.sampling.n * self._predicted_left(g, 0) for g in self.waiting)
        return EngineLoad(samples, tokens)

    def _predicted_left(self, g: _Group, emitted: int) -> int:
        cap = min(g.sampling.max_new_tokens, self.config.max_seq_len - len(g.prompt)) - emitted
        mean = self.history.mean_length(tuple(g.prompt)) if self.history is not None else None
        return cap if mean is None else max(1, min(cap, round(mean) - emitted))

    def generate(self, requests: Iterable[Request]) -> list[SampleOutput]:
        """Queue the requests and step until everything finished; outputs in finish order."""
        for r in requests:
            self.add_request(
                r.request_id,
                r.prompt_ids,
                r.sampling,
                prompt_index=r.prompt_index,
                return_hidden_states=r.return_hidden_states,
                speculative=r.speculative,
            )
        out: list[SampleOutput] = []
        while self.has_work():
            out.extend(self.step())
        return out

    def strategy_snapshot(self) -> dict[int, dict[str, dict[str, float | int | None]]]:
        """Per batch bucket, per arm ("plain" too with the measured gate): steps taken (count),
        median measured reward, predicted reward (cost model; None without one) and the
        estimate the gate decides on, all in tokens/s."""
        snap = self.bandit.snapshot()
        if not isinstance(self.bandit, BucketedEpsilonGreedy):
            return snap
        for bucket, arms in snap.items():
            priors = self._priors(bucket) or {}
            est = self.bandit.estimates(bucket, priors)
            for name, arm in arms.items():
                arm["predicted_reward"] = priors.get(name)
                arm["estimate"] = est[name] if est[name] > float("-inf") else None
        return snap

    def gate_snapshot(self) -> dict[str, object]:
        """The SD gate at a glance: gate kind, cost model (ms per bucket), acceptance per
        drafter, and per bucket the predicted and measured best arm and gain over plain
        decoding, and whether the gate speculates there now (gate.verdicts)."""
        cfg = self.config
        per_bucket = verdicts(self.strategy_snapshot())
        return {
            "gate": cfg.gate if cfg.spec_mode == "adaptive" else cfg.spec_mode,
            "costs": self.costs.as_dict() if self.costs is not None else None,
            "acceptance": self.gate_state.snapshot() if self.gate_state is not None else {},
            "buckets": per_bucket,
            "speculating_buckets": [b for b, v in per_bucket.items() if v["speculates"]],
        }

    def _priors(self, batch_size: int) -> dict[str, float] | None:
        """Predicted tokens/s per arm at this batch size's bucket (None: no cost model there)."""
        if self.costs is None or self.gate_state is None:
            return None
        bucket = self.gate_state.bandit.bucket(batch_size)
        cost = self.costs.buckets.get(bucket)
        if cost is None:
            return None
        return arm_rewards(cost, bucket, self.gate_state.tokens_per_step())

    # -- weights --------------------------------------------------------------------------------

    def set_drafter(self, drafter: EagleDrafter | None, version: int) -> None:
        """Swap the EAGLE drafter between steps (None: n-gram only).

        Samples that started while a drafter was set keep their target hidden states, so a
        new drafter catches up on them (one drafter prefill at their next EAGLE step) and the
        long-tail samples benefit from a drafter trained while they run. Samples that started
        without any drafter have no such history and keep using the n-gram drafter.
        """
        self.drafter = drafter
        self.drafter_version = version if drafter is not None else 0
        if drafter is not None:
            drafter.attach(self.model)
            if self.eagle_cache is None:
                # Drafting writes up to k - 1 positions past a sequence's committed length.
                margin = max(st.k for st in self.config.strategies)
                self.eagle_cache = drafter.new_cache(
                    self.config.max_batch, self.config.max_seq_len + margin
                )
            self.eagle_cache.reset()
        else:
            self.eagle_cache = None
        for s in self.running:
            s.eagle_ok = drafter is not None and s.history is not None
            s.eagle_hidden, s.eagle_tokens = [], []
            if s.eagle_ok and s.history:
                s.eagle_hidden = [torch.cat(s.history)]
                s.eagle_tokens = (s.group.prompt + s.tokens)[1:]

    def load_policy(self, path_or_state_dict: str | Path | dict[str, Tensor], version: int) -> None:
        """Load new target weights (HF names) between steps; later samples carry `version`.

        Running samples continue on the new weights from their next token, and each records
        where its tokens switched version (SampleOutput.policy_spans). Their KV cache is kept
        as the previous weights computed it (the prompt and the tokens before the switch are
        not recomputed), as asynchronous RL systems do: a token after the switch is drawn from
        the new weights attending to keys and values of the old ones, and its logprob is that
        of this mixed computation. Drain or cancel them first if every sample must come from a
        single policy version.
        """
        sd = path_or_state_dict
        if not isinstance(sd, dict):
            cfg = ModelConfig.from_hf(json.loads((Path(sd) / "config.json").read_text()))
            if cfg != self.model.config:
                raise ValueError(
                    f"{sd} is another architecture than the loaded model: {cfg} != "
                    f"{self.model.config}"
                )
            sd = read_state_dict(sd)
        p = next(self.model.parameters())
        load_weights(self.model, {k: v.to(dtype=p.dtype, device=p.device) for k, v in sd.items()})
        self.policy_version = version
        for g in self.waiting:
            g.policy_version = version
        for s in self.running:
            if s.spans[-1][0] == len(s.tokens):  # no token since the last switch
                s.spans.pop()
            if not s.spans or s.spans[-1][1] != version:
                s.spans.append((len(s.tokens), version))

    # -- the loop -------------------------------------------------------------------------------

    def step(self) -> list[SampleOutput]:
        """One iteration: admit + prefill waiting prompts if they fit, else one decode step."""
        out, self._outputs = self._outputs, []
        admitted = self._schedule()
        if admitted:
            out.extend(self._prefill(admitted))
        elif self.running:
            out.extend(self._decode())
        return out

    def _schedule(self) -> list[_Group]:
        """FIFO admission of whole prompts (all n samples) while slots and the budget allow."""
        free = self.config.max_batch - len(self.running)
        admitted: list[_Group] = []
        width = 0
        while self.waiting and self.waiting[0].sampling.n <= free:
            g = self.waiting[0]
            w = max(width, len(g.prompt))
            if admitted and w * (len(admitted) + 1) > self.config.max_prefill_tokens:
                break
            admitted.append(self.waiting.popleft())
            free -= g.sampling.n
            width = w
        return admitted

    def _need_hidden(self, seqs: Iterable[_Seq]) -> bool:
        return self.drafter is not None or any(s.history is not None for s in seqs)

    def _prefill(self, groups: list[_Group]) -> list[SampleOutput]:
        """Prefill each prompt once (leader slots), fork its KV into its n sample slots."""
        t0 = time.perf_counter()
        b0, n_groups = len(self.running), len(groups)
        width = max(len(g.prompt) for g in groups)
        tokens = torch.zeros(n_groups, width, dtype=torch.long)
        for i, g in enumerate(groups):
            tokens[i, : len(g.prompt)] = torch.tensor(g.prompt)
        lens = [len(g.prompt) for g in groups]
        batch = Batch.make([0] * n_groups, lens, width, b0, self.cache.trash, self.device)
        scored = [g.sampling.prompt_logprobs is not None for g in groups]
        need_hidden = self.drafter is not None or any(g.return_hidden for g in groups)
        need_hidden = need_hidden or any(scored)
        logits, hidden = self.model(
            tokens.to(self.device), self.cache, batch, last_only=True, return_hidden=need_hidden
        )
        self.prefills += n_groups
        for i, g in enumerate(groups):
            if scored[i] and hidden is not None:
                g.prompt_lp = self._prompt_logprobs(g, hidden[i, : lens[i]])
        new, order = self._place(groups, b0, lens)
        # Every sample draws its own first token from its prompt's last-position logits.
        row_logits = logits[torch.tensor(order, device=self.device)]
        toks, lps, tops = self._sample(new, row_logits)
        done: dict[int, FinishReason] = {}
        for r, s in enumerate(new):
            g = s.group
            if hidden is not None:
                gi = order[r]
                # A copy: a view would keep the whole batch's hidden tensor alive.
                h = hidden[gi, : len(g.prompt)].clone()
                if s.history is not None:
                    s.history.append(h)
                if s.eagle_ok:
                    s.eagle_hidden.append(h)
                    s.eagle_tokens.extend(g.prompt[1:])
            reason = self._emit(s, [toks[r]], [lps[r]], None, tops=tops[r] if tops else None)
            if reason is not None:
                done[b0 + r] = reason
        self.stats.first_tokens += len(new)
        self.stats.record_phase("prefill", time.perf_counter() - t0)
        return self._finish(done)

    @torch.inference_mode()
    def _prompt_logprobs(self, g: _Group, hidden: Tensor) -> PromptLogprobs:
        """The target's logprob and rank of each prompt token after the first, and the top
        alternatives asked for, from the prefill's hidden states [len(prompt), H] and in the
        distribution the group's sampled logprobs refer to (its temperature, top-k, top-p and
        logprob mode)."""
        sp = g.sampling
        logits = self.model.logits(hidden[:-1]).float()[None]  # position j predicts token j + 1
        params = RowParams.make(
            [sp.temperature],
            [sp.top_k],
            [sp.top_p],
            self.device,
            raw=[sp.logprob_mode is LogprobMode.RAW],
        )
        dist = returned_logprobs(logits, log_probs(logits, params), params)[0]
        target = torch.tensor(g.prompt[1:], device=self.device)
        lp = dist.gather(-1, target[:, None])
        ranks = (dist >= lp).sum(dim=-1)  # vLLM's rank: tokens at least as likely, itself too
        top: tuple[TopLogprobs, ...] = ()
        n = min(sp.prompt_logprobs or 0, dist.shape[-1])
        if n > 0 and len(target):
            vals, ids = dist.topk(n, dim=-1)
            top = tuple(
                TopLogprobs(tuple(i), tuple(v))
                for v, i in zip(vals.tolist(), ids.tolist(), strict=True)
            )
        return PromptLogprobs(tuple(lp[:, 0].tolist()), tuple(ranks.tolist()), top)

    def _place(
        self, groups: list[_Group], b0: int, lens: list[int]
    ) -> tuple[list[_Seq], list[int]]:
        """Give the prefilled prompts their n slots each; returns the new rows and their group.

        Leaders (sample 0 of each group) sit in the prefilled slots [b0, b0 + G); the other
        samples follow group by group, their KV copied from the leader.
        """
        leaders: list[_Seq] = []
        followers: list[_Seq] = []
        nxt = b0 + len(groups)
        for i, g in enumerate(groups):
            self.cache.lens[b0 + i] = lens[i]
            self.cache.fork(b0 + i, nxt, nxt + g.sampling.n - 1)
            nxt += g.sampling.n - 1
            if self._ngram_on:
                self.ngram.add_group(g.group_key, g.prompt)
            if self.history is not None:
                g.history_key = self.history.open(g.prompt, g.past)
                g.past = ()  # held by the drafter now (or dropped by its bound)
                if self.gate_state is not None and self.history.mean_length(g.history_key):
                    self.gate_state.history_arrived()
            g.live = g.sampling.n
            max_new = min(g.sampling.max_new_tokens, self.config.max_seq_len - len(g.prompt))
            for j in range(g.sampling.n):
                idx = g.sample_offset + j
                s = _Seq(g, idx, row_key(g.seed, g.prompt_index, idx), max_new)
                s.eagle_ok = self.drafter is not None
                if s.eagle_ok and s.history is None:
                    s.history = []  # lets a later drafter version catch up on this sample
                if self._ngram_on:
                    self.ngram.add_sequence(g.group_key, s.sample_key)
                if self.history is not None:
                    s.answer_id = self.history.start(
                        g.history_key, (g.request_id, g.prompt_index, idx)
                    )
                (leaders if j == 0 else followers).append(s)
        self.running.extend(leaders + followers)
        order = list(range(len(groups))) + [
            i for i, g in enumerate(groups) for _ in range(g.sampling.n - 1)
        ]
        return leaders + followers, order

    def _decode(self) -> list[SampleOutput]:
        strategy = self._choose(len(self.running))
        if strategy is None:
            return self._plain_step()
        return self._spec_step(strategy)

    def _choose(self, b: int) -> Strategy | None:
        """The SD gate: the strategy of the next decode step, None for a plain step."""
        cfg = self.config
        if cfg.spec_mode == "off" or not any(s.group.speculative for s in self.running):
            return None
        if not self._measured and b > cfg.batch_threshold:
            return None
        if self.gate_state is not None:
            self.gate_state.sync(self.policy_version, self.drafter_version)
        available = {"ngram"}
        if self._history_ready():
            available.add("history")
        if self.drafter is not None and any(s.eagle_ok for s in self.running):
            available.add("eagle")
        untried = self.gate_state.untried(available) if self.gate_state is not None else None
        try:
            return self.bandit.choose(b, available, self._priors(b), untried)
        except NoStrategyAvailable:
            return None

    def _history_ready(self) -> bool:
        """Whether the history arm is offered: when at least half of the speculative rows'
        prompts have finished answers in the history. Before, its drafts come from the live
        siblings alone, which the n-gram arm drafts from too, and rewards measured then would
        rank the arm for the prompts' next epoch by what it does without one."""
        if self.history is None:
            return False
        rows = [s for s in self.running if s.group.speculative]
        ready = sum(1 for s in rows if self.history.mean_length(s.group.history_key) is not None)
        return 2 * ready >= len(rows)

    def _params(self) -> RowParams:
        return self._row_params(self.running)

    def _row_params(self, seqs: Sequence[_Seq]) -> RowParams:
        ss = [s.group.sampling for s in seqs]
        return RowParams.make(
            [p.temperature for p in ss],
            [p.top_k for p in ss],
            [p.top_p for p in ss],
            self.device,
            raw=[p.logprob_mode is LogprobMode.RAW for p in ss],
        )

    def _keys(self, seqs: Sequence[_Seq]) -> Tensor:
        return torch.tensor([s.key for s in seqs], dtype=torch.long, device=self.device)

    def _sample(
        self, seqs: Sequence[_Seq], logits: Tensor
    ) -> tuple[list[int], list[float], list[list[TopLogprobs]] | None]:
        """Draw one token per row from logits [B, V]; returns tokens, their logprobs and the
        rows' top alternatives (self._tops)."""
        params = self._row_params(seqs)
        logp = log_probs(logits, params)
        if params.all_greedy:
            tok = logp.argmax(dim=-1)
        else:
            pos = torch.tensor([[len(s.tokens)] for s in seqs], device=self.device)
            u = uniforms(self._keys(seqs), pos, SAMPLE)[:, 0]
            tok = sample_from(logp.exp(), u)
            if params.any_greedy:
                tok = torch.where(params.greedy, logp.argmax(dim=-1), tok)
        lp = token_logprobs(logits, logp, tok, params)
        return tok.tolist(), lp.tolist(), self._tops(seqs, logits[:, None], logp[:, None], params)

    def _tops(
        self, seqs: Sequence[_Seq], logits: Tensor, logp: Tensor, params: RowParams
    ) -> list[list[TopLogprobs]] | None:
        """Per row, per position of logits [B, W, V], the top alternatives the row asked for
        ([] for a row that did not ask), read from the target distribution its logprobs refer
        to; None, at no cost, when no row asked."""
        wants = [s.group.sampling.top_logprobs for s in seqs]
        k = min(max(wants), logits.shape[-1])
        if k <= 0:
            return None
        rows = [r for r, n in enumerate(wants) if n > 0]
        at = torch.tensor(rows, device=self.device)
        dist = returned_logprobs(logits[at], logp[at], _select(params, at))
        vals, ids = dist.topk(k, dim=-1)
        out: list[list[TopLogprobs]] = [[] for _ in seqs]
        for r, v, i in zip(rows, vals.tolist(), ids.tolist(), strict=True):
            n = wants[r]
            out[r] = [TopLogprobs(tuple(a[:n]), tuple(b[:n])) for b, a in zip(v, i, strict=True)]
        return out

    def _plain_step(self) -> list[SampleOutput]:
        t0 = time.perf_counter()
        seqs, lens = self.running, self.cache.lens
        b = len(seqs)
        tokens = torch.tensor([[s.tokens[-1]] for s in seqs], device=self.device)
        batch = Batch.make(lens[:b], None, 1, 0, self.cache.trash, self.device)
        need_hidden = self._need_hidden(seqs)
        logits, hidden = self.model(
            tokens, self.cache, batch, last_only=True, return_hidden=need_hidden
        )
        toks, lps, tops = self._sample(seqs, logits)
        done: dict[int, FinishReason] = {}
        for i, s in enumerate(seqs):
            lens[i] += 1
            s.plain_steps += 1
            h = hidden[i] if hidden is not None else None
            reason = self._emit(s, [toks[i]], [lps[i]], h, tops=tops[i] if tops else None)
            if reason is not None:
                done[i] = reason
        dt = time.perf_counter() - t0
        self.stats.record_plain_step(b, b, dt)
        if self._measured and isinstance(self.bandit, BucketedEpsilonGreedy):
            self.bandit.record_plain(b, dt)
        return self._finish(done)

    def _spec_step(self, strategy: Strategy) -> list[SampleOutput]:
        """Draft up to k tokens per row, verify all rows in one target forward, accept/reject."""
        # Long on purpose: draft -> verify -> accept -> emit of one step, with shared tensors.
        t0 = time.perf_counter()
        seqs, lens = self.running, self.cache.lens
        b = len(seqs)
        params = self._params()
        self._catch_up_s = 0.0
        drafts, dlen, q, kinds = self._propose(strategy, params)
        t1 = time.perf_counter()
        # Row i feeds its pending token + its dlen[i] drafts (padding to the widest row).
        width = 1 + max(dlen)
        rows = [
            [s.tokens[-1]] + d[:n] + [0] * (width - 1 - n)
            for s, d, n in zip(seqs, drafts, dlen, strict=True)
        ]
        tokens = torch.tensor(rows, device=self.device)
        batch = Batch.make(lens[:b], [1 + n for n in dlen], width, 0, self.cache.trash, self.device)
        logits, hidden = self.model(
            tokens, self.cache, batch, return_hidden=self._need_hidden(seqs)
        )
        logp = log_probs(logits, params)  # [B, width, V]: p at every verified position
        keys = self._keys(seqs)
        base = torch.tensor([len(s.tokens) for s in seqs], device=self.device)
        pos = base[:, None] + torch.arange(width, device=self.device)[None, :]
        draft_t = tokens[:, 1:]
        n_acc, nxt = accept_drafts(
            logp.exp(),
            draft_t,
            batch.n_new - 1,
            None if q is None else q[:, : width - 1],
            params.greedy,
            uniforms(keys, pos[:, :-1], ACCEPT),
            uniforms(keys, pos, SAMPLE),
            logp.argmax(dim=-1),
            self._q_rows(kinds, q),
        )
        # Row i emits draft[:n_i] + [next_i]; logprobs come from the target's p (or its raw
        # logits, for rows asking for raw logprobs).
        emitted = torch.cat([draft_t, torch.zeros_like(nxt)[:, None]], dim=1)
        emitted[torch.arange(b, device=self.device), n_acc] = nxt
        emitted_lp = token_logprobs(logits, logp, emitted, params)
        tops = self._tops(seqs, logits, logp, params)  # the verify pass's target alternatives
        n_list, em, em_lp = n_acc.tolist(), emitted.tolist(), emitted_lp.tolist()
        if self.gate_state is not None:  # acceptance as drafted, before stop-token clipping
            self._observe(kinds, dlen, n_list)
        done: dict[int, FinishReason] = {}
        gained: list[int] = []  # tokens each row emitted (fewer than n + 1 past a stop token)
        for i, s in enumerate(seqs):
            n = n_list[i]
            lens[i] += 1 + n  # rejected positions past this are stale: the rollback
            if dlen[i]:
                s.draft_steps += 1
                if kinds[i] == "eagle":
                    s.drafter_version = self.drafter_version
            else:  # nothing drafted (speculative=False, no EAGLE history, at its limit...):
                s.plain_steps += 1  # the verify pass was a plain decode step for this row
            h = hidden[i] if hidden is not None else None
            before = len(s.tokens)
            origin = None
            if s.provenance is not None:
                origin = step_provenance(n, dlen[i], kinds[i])
            top = tops[i][: n + 1] if tops else None
            reason = self._emit(s, em[i][: n + 1], em_lp[i][: n + 1], h, origin, top)
            gained.append(len(s.tokens) - before)
            n_list[i] = min(n, gained[-1])  # drafts past a stop token do not count as accepted
            s.accepted += n_list[i]
            s.drafted += dlen[i]
            if dlen[i] and gained[-1] > n_list[i]:  # the target's own draw was emitted
                if n == dlen[i]:
                    s.bonus += 1
                else:
                    s.residual += 1
            if reason is not None:
                done[i] = reason
        t2 = time.perf_counter()
        # Over all rows: the reward is the step's throughput (every row's tokens per second, as
        # the plain arm's b / dt is), and rows that drafted nothing still cost and gain in it.
        # A drafter catch-up is left out: charged to the one step that ran it, it would make
        # EAGLE's first step after a plain run look many times slower than EAGLE is.
        self.bandit.record(b, strategy, sum(gained) / b, t2 - t0 - self._catch_up_s)
        self.stats.record_spec_step(b, strategy, dlen, n_list, gained, t1 - t0, t2 - t1, kinds)
        return self._finish(done)

    def _propose(
        self, strategy: Strategy, params: RowParams
    ) -> tuple[list[list[int]], list[int], Tensor | None, list[str]]:
        """Drafts per row, how many of them to verify, q (None: deterministic drafts) and
        which drafter proposed each row."""
        seqs, k = self.running, strategy.k
        # Per-row budget: leave room for the target's own token within max_new_tokens (which
        # already includes the max_seq_len limit).
        cap = [min(k, s.max_new - len(s.tokens) - 1) if s.group.speculative else 0 for s in seqs]
        kinds = [strategy.drafter] * len(seqs)
        q = None
        if strategy.drafter == "eagle":
            cap = [c if s.eagle_ok else 0 for c, s in zip(cap, seqs, strict=True)]
            drafts_t, q, confident = self._eagle_drafts(seqs, params, k)
            drafts = drafts_t.tolist()
            cap = [min(c, n) for c, n in zip(cap, confident, strict=True)]
        elif strategy.drafter == "history" and self.history is not None:
            drafts, q = self._history_drafts(seqs, cap, params, kinds)
        else:
            drafts = [
                self.ngram.propose(s.group.group_key, s.sample_key, c) if c > 0 else []
                for s, c in zip(seqs, cap, strict=True)
            ]
        dlen = [min(len(d), c) for d, c in zip(drafts, cap, strict=True)]
        return drafts, dlen, q, kinds

    def _history_drafts(
        self, seqs: list[_Seq], cap: list[int], params: RowParams, kinds: list[str]
    ) -> tuple[list[list[int]], Tensor | None]:
        """The history arm: each row's walk over its prompt's history; rows whose walk is
        shorter than HISTORY_MIN_DRAFT take EAGLE drafts instead (`kinds` marks them), when a
        drafter is loaded. EAGLE runs only when some row needs it."""
        assert self.history is not None
        hist = self.history
        drafts = [
            hist.propose(s.group.history_key, s.answer_id, c) if c > 0 else []
            for s, c in zip(seqs, cap, strict=True)
        ]
        fallback = [
            i
            for i, (s, d, c) in enumerate(zip(seqs, drafts, cap, strict=True))
            if c > 0 and len(d) < min(HISTORY_MIN_DRAFT, c) and s.eagle_ok
        ]
        if not fallback or self.drafter is None or self._eagle_k == 0:
            return drafts, None
        eagle_t, q, confident = self._eagle_drafts(seqs, params, min(self._eagle_k, max(cap)))
        eagle = eagle_t.tolist()
        for i in fallback:
            drafts[i] = eagle[i][: min(cap[i], confident[i])]
            kinds[i] = "eagle"
        return drafts, q

    def _q_rows(self, kinds: list[str], q: Tensor | None) -> Tensor | None:
        """Rows drafted from q (EAGLE rows of a history step); None: all of them, or no q."""
        if q is None or all(kind == "eagle" for kind in kinds):
            return None
        return torch.tensor([kind == "eagle" for kind in kinds], device=self.device)

    def _observe(self, kinds: list[str], dlen: list[int], n_list: list[int]) -> None:
        """Acceptance per drafter: a history step's EAGLE rows count for EAGLE."""
        assert self.gate_state is not None
        for kind in dict.fromkeys(kinds):
            rows = [i for i, k in enumerate(kinds) if k == kind]
            self.gate_state.observe(kind, [dlen[i] for i in rows], [n_list[i] for i in rows])

    def _eagle_drafts(
        self, seqs: list[_Seq], params: RowParams, k: int
    ) -> tuple[Tensor, Tensor | None, list[int]]:
        assert self.drafter is not None and self.eagle_cache is not None
        feats = [torch.cat(s.eagle_hidden) if s.eagle_ok and s.eagle_hidden else None for s in seqs]
        toks = [s.eagle_tokens if s.eagle_ok else [] for s in seqs]
        if max(map(len, toks)) > CATCH_UP_BACKLOG * (k + 1):
            # Rows that decoded without the drafter (plain steps, n-gram steps) first catch up
            # on those positions, all but each row's last pair, in one drafter forward timed
            # apart: a one-off cost per position decoded without it, not a cost of this step.
            t0 = time.perf_counter()
            self.drafter.absorb(
                self.eagle_cache,
                [f[:-1] if f is not None else None for f in feats],
                [t[:-1] for t in toks],
            )
            feats = [f[-1:] if f is not None else None for f in feats]
            toks = [t[-1:] for t in toks]
            self._catch_up_s += time.perf_counter() - t0
        keys = self._keys(seqs)
        base = torch.tensor([len(s.tokens) for s in seqs], device=self.device)

        def choose(logits: Tensor, i: int) -> tuple[Tensor, Tensor | None, Tensor]:
            logq = log_probs(logits, params)
            greedy_tok = logq.argmax(dim=-1)
            # Confidence = the largest drafter probability: a property of q alone. It must not
            # depend on the token actually drawn, or dropping unlikely draws would change the
            # proposal law that the accept rule assumes (and the output would be biased).
            conf = logq.max(dim=-1).values.exp()
            if params.all_greedy:
                return greedy_tok, None, conf
            qd = logq.exp()
            u = uniforms(keys, (base + i)[:, None], DRAFT)[:, 0]
            return torch.where(params.greedy, greedy_tok, sample_from(qd, u)), qd, conf

        out = self.drafter.propose(
            self.eagle_cache, feats, toks, k, choose, self.config.draft_confidence
        )
        for s in seqs:
            s.eagle_hidden, s.eagle_tokens = [], []
        return out

    # -- bookkeeping ------------------------------------------------------------------------

    def _emit(
        self,
        s: _Seq,
        toks: list[int],
        lps: list[float],
        hidden_rows: Tensor | None,
        origin: list[TokenProvenance] | None = None,
        tops: list[TopLogprobs] | None = None,
    ) -> FinishReason | None:
        """Append tokens (stopping early at a stop token or the length limit); `origin`:
        each token's provenance (None: plain draws); `tops`: each token's top alternatives."""
        reason = None
        n = 0
        for t, lp in zip(toks, lps, strict=True):
            s.tokens.append(t)
            s.logprobs.append(lp)
            n += 1
            if t in s.stop:
                reason = FinishReason.STOP
                break
            if len(s.tokens) >= s.max_new:
                reason = FinishReason.LENGTH
                break
        if s.provenance is not None:
            s.provenance.extend(origin[:n] if origin is not None else [PLAIN_TOKEN] * n)
        if s.top is not None and tops is not None:
            s.top.extend(tops[:n])
        if hidden_rows is not None:
            # hidden_rows[j] is the state at the position fed just before emitted token j.
            # A copy: a view would keep the whole step's [B, width, H] tensor alive for as
            # long as this (possibly long-tail) sample runs.
            h = hidden_rows[:n].clone()
            if s.history is not None:
                s.history.append(h)
            if s.eagle_ok:
                s.eagle_hidden.append(h)
        if s.eagle_ok:
            s.eagle_tokens.extend(s.tokens[-n:])
        g = s.group
        if self._ngram_on:
            self._ngram_pending.append((g.group_key, s.index, s.sample_key, s.tokens[-n:]))
        if self.history is not None:
            self._history_pending.append((g.group_key, s.index, s, s.tokens[-n:]))
        return reason

    def _finish(self, done: dict[int, FinishReason]) -> list[SampleOutput]:
        """Report finished rows and compact: the last running row moves into each freed slot."""
        self._index_emitted()
        out: list[SampleOutput] = []
        for slot in sorted(done, reverse=True):
            s = self.running[slot]
            out.append(self._output(s, done[slot]))
            last = len(self.running) - 1
            self.cache.move(last, slot)
            if self.eagle_cache is not None:
                self.eagle_cache.move(last, slot)
            self.running[slot] = self.running[last]
            self.running.pop()
            g = s.group
            if self.history is not None:
                self.history.finish(g.history_key, s.answer_id)
            if self._ngram_on:
                self.ngram.remove_sequence(g.group_key, s.sample_key)
            g.live -= 1
            if g.live == 0:
                if self._ngram_on:
                    self.ngram.remove_group(g.group_key)
        out.reverse()
        return out

    def _index_emitted(self) -> None:
        """Index the step's emitted tokens in the n-gram drafter, in a batch-independent order."""
        pending, self._ngram_pending = self._ngram_pending, []
        for group_key, _, sample_key, toks in sorted(pending, key=lambda p: (p[0], p[1])):
            self.ngram.extend(group_key, sample_key, toks)
        if self.history is not None:
            hist, self._history_pending = self._history_pending, []
            for _, _, s, toks in sorted(hist, key=lambda p: (p[0], p[1])):
                self.history.extend(s.group.history_key, s.answer_id, toks)

    def _output(self, s: _Seq, reason: FinishReason) -> SampleOutput:
        hidden = None
        if s.group.return_hidden and s.history is not None:
            # On the host: a finished sample crosses a process pipe to the training buffer.
            hidden = torch.cat(s.history)[: len(s.group.prompt) + len(s.tokens) - 1].cpu()
        g = s.group
        return SampleOutput(
            g.request_id,
            g.prompt_index,
            s.index,
            s.tokens,
            s.logprobs,
            reason,
            g.policy_version,
            s.drafter_version,
            s.draft_steps,
            s.plain_steps,
            s.accepted,
            hidden,
            drafted_tokens=s.drafted,
            bonus_tokens=s.bonus,
            residual_tokens=s.residual,
            provenance=s.provenance,
            policy_spans=tuple(s.spans) if len(s.spans) > 1 else (),
            top_logprobs=s.top,
            prompt_logprobs=g.prompt_lp,
        )


def _select(params: RowParams, rows: Tensor) -> RowParams:
    """The sampling parameters of some rows only (what `returned_logprobs` reads of them)."""
    raw = params.raw
    return RowParams(
        params.temperature[rows],
        params.top_k[rows],
        params.top_p[rows],
        params.greedy[rows],
        params.all_greedy,
        params.any_greedy,
        params.restrict,
        None if raw is None else raw[rows],
    )
