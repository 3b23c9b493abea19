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
    EngineConfig.from_spec(EngineSpec.for_job(...))  # a job's speculative config -> engine's
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
- A request with a `cache_key` (a session's turn) leaves its sample's KV kept under the key,
  and a later prompt with the key prefills only what it does not share with it (lossless;
  prefix_cache.py says when nothing is reused). A session's first prompt with a `share_key`
  is kept under that key at prefill, for the other sessions of that prompt.
- Where the parts live: admission.py (waiting prompts, their slots), speculation.py (the gate,
  the drafts, the verify pass), emission.py (tokens into their samples and the drafters'
  corpora, a finished sample's output), rows.py (a running sample and its prompt),
  prefix_cache.py (sessions' KV kept between turns).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from tltd.contract.lengths import new_token_cap, predicted_left
from tltd.domain import (
    FinishReason,
    LogprobMode,
    PromptLogprobs,
    Sample,
    SamplingParams,
    TopLogprobs,
)
from tltd_workers.engine.admission import Admission
from tltd_workers.engine.bandit import BucketedEpsilonGreedy, FixedStrategy
from tltd_workers.engine.costs import CostModel, measure_costs
from tltd_workers.engine.datatypes import EngineConfig, EngineLoad, Request, SampleOutput
from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.engine.emission import Emission, sample_output
from tltd_workers.engine.gate import GateState, verdicts
from tltd_workers.engine.history import HistoryDrafter
from tltd_workers.engine.ngram import NgramDrafter
from tltd_workers.engine.prefix_cache import PrefixCache
from tltd_workers.engine.rows import Group, Seq, row_keys, row_params, top_alternatives
from tltd_workers.engine.sampling import (
    SAMPLE,
    RowParams,
    log_probs,
    returned_logprobs,
    sample_from,
    token_logprobs,
    uniforms,
)
from tltd_workers.engine.speculation import Speculation
from tltd_workers.engine.stats import EngineStats
from tltd_workers.engine.transformer import (
    Batch,
    CausalLM,
    ModelConfig,
    load_model,
    load_weights,
    read_state_dict,
)

__all__ = ["Engine", "EngineConfig", "EngineLoad", "Request", "SampleOutput"]


class Engine:
    """Continuous-batching rollout engine (module docstring): the slots and the loop; admission,
    speculation and emission are its collaborators."""

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
        self.config = cfg = _checked(config or EngineConfig())
        if isinstance(model_or_path, CausalLM):
            self.model = model_or_path.to(dtype=cfg.dtype, device=cfg.device).eval()
        else:
            self.model = load_model(model_or_path, cfg.dtype, cfg.device)
        self.device = torch.device(cfg.device)
        self.cache = self.model.new_cache(cfg.max_batch, cfg.max_seq_len)
        self.running: list[Seq] = []  # running[i] lives in cache slot i
        self.policy_version = 0
        self.stats = EngineStats()
        self.prefills = 0  # prefill forwards run (one per prompt, shared by its n samples)
        self._outputs: list[SampleOutput] = []  # finished outside step() (cancel)
        self.ngram = NgramDrafter(cfg.ngram_max_match, cfg.ngram_min_match)
        # Indexing every emitted token costs Python time: only when n-grams may be proposed.
        ngram_on = cfg.spec_mode != "off" and any(st.drafter == "ngram" for st in cfg.strategies)
        corpus = self.ngram if ngram_on else None
        # Answers of earlier samples per prompt (history.py).
        self.history: HistoryDrafter | None = None
        if cfg.spec_mode != "off" and any(st.drafter == "history" for st in cfg.strategies):
            self.history = HistoryDrafter(cfg.history_max_tokens, cfg.history_max_prompt_tokens)
        self.bandit, self.gate_state = gate_for(cfg, gate_state)
        # The measured gate's priors (speculation.py).
        self.costs = self._cost_model(costs) if cfg.measured_gate else None
        vocab = self.model.config.vocab_size
        self.admission = Admission(
            cfg, vocab, self.running, self.cache, corpus, self.history, self.gate_state
        )
        self.emission = Emission(corpus, self.history)
        self.prefix = PrefixCache(cfg.prefix_cache_bytes)  # sessions' KV between turns
        self.speculation = Speculation(
            cfg,
            self.model,
            self.cache,
            self.running,
            ngram=self.ngram,
            history=self.history,
            bandit=self.bandit,
            gate_state=self.gate_state,
            costs=self.costs,
            stats=self.stats,
            emission=self.emission,
        )

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
        resume: Sample | None = None,
        pause_after: int = 0,
        cache_key: str = "",
        share_key: str = "",
    ) -> None:
        """Queue one prompt with sampling.n samples; it joins the batch at a step boundary.

        `sample_offset` numbers the samples offset .. offset + n - 1 (their index and their
        randomness key), so that a worker can run any contiguous slice of a prompt's samples and
        a retried slice reproduces the same tokens (n-gram drafts: see the module docstring).
        `history`: earlier answers to this prompt (a sample id and its tokens each, oldest
        first, e.g. read from the store) that the history drafter adds when the prompt is
        admitted, unless it holds them already.
        `resume`: sample `sample_offset` (n = 1) as stored unfinished (its tokens, logprobs,
        per-token versions, counters): it goes on from its next token, drawn with the same
        randomness (key, position) it would have had, from the prompt and its tokens
        prefilled on this engine's weights; a version other than its last opens a new span.
        `pause_after`: a step's token budget; a sample that emits this many tokens here
        unfinished ends ABORTED with them (paused; resumed later with `resume`).
        `cache_key`: a session's key (prefix_cache.py): a sample of n = 1 leaves its KV kept
        under it, and the prompt reuses the KV kept under it where they share a prefix.
        `share_key`: a session's first prompt (with a `cache_key`): its KV is kept under this
        key at prefill, and other prompts with the key reuse it (a group of sessions).
        """
        self.admission.add(
            request_id,
            prompt_ids,
            sampling,
            prompt_index=prompt_index,
            return_hidden=return_hidden_states,
            speculative=speculative,
            sample_offset=sample_offset,
            past=history,
            policy_version=self.policy_version,
            resume=resume,
            pause_after=pause_after,
            cache_key=cache_key,
            share_key=share_key,
        )

    @property
    def waiting(self) -> deque[Group]:
        """Prompts waiting for slots, in admission order."""
        return self.admission.waiting

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._outputs)

    def cancel(self, request_id: str) -> None:
        """Finish every sample of the request as CANCELLED (reported by the next step())."""
        self._outputs.extend(self.admission.cancel(request_id))
        done = {
            i: FinishReason.CANCELLED
            for i, s in enumerate(self.running)
            if s.group.request_id == request_id
        }
        self._outputs.extend(self._finish(done))

    def take_finished(self) -> list[SampleOutput]:
        """The outputs the next step() would report before running anything (samples a cancel
        finished), taken now without a step: a worker that is not stepping (frozen) sends a
        cancel's samples at once."""
        out, self._outputs = self._outputs, []
        return out

    def abort_all(self) -> list[SampleOutput]:
        """Cancel every request, waiting or running; returns their outputs (CANCELLED, with the
        tokens so far). Nothing is left afterwards."""
        running = {s.group.request_id for s in self.running}
        for request_id in running | {g.request_id for g in self.waiting}:
            self.cancel(request_id)
        return self.step()

    def snapshot(self) -> list[SampleOutput]:
        """The running samples with tokens, as they stand (ABORTED, no hidden states), left
        running: what a checkpoint stores to go on from (`add_request(resume=)`)."""
        return [
            sample_output(s, FinishReason.ABORTED, hidden=False) for s in self.running if s.tokens
        ]

    def load(self) -> EngineLoad:
        """What the engine holds: samples waiting or running, and the tokens they are predicted
        to still generate: per sample its prompt's mean answer length in the history drafter
        less what it emitted (at least 1, at most its `max_new_tokens` left), or its
        `max_new_tokens` left for a prompt without finished answers there."""
        samples = len(self.running) + sum(g.sampling.n for g in self.waiting)
        tokens = sum(self._predicted_left(s.group, len(s.tokens)) for s in self.running)
        tokens += sum(
            g.sampling.n * self._predicted_left(g, len(g.restore.token_ids) if g.restore else 0)
            for g in self.waiting
        )
        return EngineLoad(samples, tokens)

    def _predicted_left(self, g: Group, emitted: int) -> int:
        # The daemon predicts with the same rule before a sample runs (`RequestLedger.
        # predicted_tokens`, from the store); here the mean is what this engine's history
        # drafter holds, and without one the sample may run to its cap.
        cap = new_token_cap(g.sampling.max_new_tokens, len(g.prompt), self.config.max_seq_len)
        mean = self.history.mean_length(tuple(g.prompt)) if self.history is not None else None
        left = predicted_left(mean, cap, emitted)
        return cap - emitted if left is None else left

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
                cache_key=r.cache_key,
                share_key=r.share_key,
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
            priors = self.speculation.priors(bucket) or {}
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

    # -- weights --------------------------------------------------------------------------------

    @property
    def drafter(self) -> EagleDrafter | None:
        """The EAGLE drafter set (None: no EAGLE drafts)."""
        return self.speculation.drafter

    @property
    def drafter_version(self) -> int:
        return self.speculation.drafter_version

    def set_drafter(self, drafter: EagleDrafter | None, version: int) -> None:
        """Swap the EAGLE drafter between steps (None: n-gram only).

        Samples that started while a drafter was set keep their target hidden states, so a
        new drafter catches up on them (one drafter prefill at their next EAGLE step) and the
        long-tail samples benefit from a drafter trained while they run. Samples that started
        without any drafter have no such history and keep using the n-gram drafter.
        """
        self.speculation.set_drafter(drafter, version)

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
        self.prefix.new_weights()
        for g in self.waiting:
            g.policy_version = version
        for s in self.running:
            if s.spans[-1][0] == len(s.tokens):  # no token since the last switch
                s.spans.pop()
            if not s.spans or s.spans[-1][1] != version:
                s.spans.append((len(s.tokens), version))

    # -- the loop -------------------------------------------------------------------------------

    def step(self) -> list[SampleOutput]:
        """One iteration: schedule (admit waiting prompts if they fit), run (their prefill, else
        one decode step), postprocess (report finished samples, compact the batch)."""
        out, self._outputs = self._outputs, []
        admitted = self.admission.schedule(self._waits_for_share)
        if admitted:
            done = self._prefill(admitted)
        elif self.running:
            done = self._decode()
        else:
            return out
        out.extend(self._finish(done))
        return out

    def _waits_for_share(self, share_key: str) -> bool:
        """A prompt whose share key another prompt of this admission prefills now waits one
        step, then reuses that prefill's KV (not when nothing would be kept or reused)."""
        return self.prefix.sharing(share_key)

    def _prefill(self, groups: list[Group]) -> dict[int, FinishReason]:
        """Prefill each prompt once (leader slots), fork its KV into its n sample slots, and
        draw each sample's first token; returns the slots whose samples finished."""
        t0 = time.perf_counter()
        b0, n_groups = len(self.running), len(groups)
        contexts = [g.context for g in groups]
        scored = [g.sampling.prompt_logprobs is not None for g in groups]
        need_hidden = self.drafter is not None or any(g.return_hidden for g in groups)
        need_hidden = need_hidden or any(scored)
        # Positions restored from a session's kept KV are not fed again (prefix_cache.py).
        reused, restored = self.prefix.admit(groups, b0, self.cache, need_hidden)
        lens = [len(c) for c in contexts]
        fed = [len(c) - m for c, m in zip(contexts, reused, strict=True)]
        width = max(fed)
        tokens = torch.zeros(n_groups, width, dtype=torch.long)
        for i, c in enumerate(contexts):
            tokens[i, : fed[i]] = torch.tensor(c[reused[i] :])
        batch = Batch.make(reused, fed, width, b0, self.cache.trash, self.device)
        logits, hidden = self.model(
            tokens.to(self.device), self.cache, batch, last_only=True, return_hidden=need_hidden
        )
        self.prefills += n_groups
        if hidden is not None and any(reused):
            hidden = _with_restored(hidden, restored, fed)
        self.prefix.share(groups, b0, self.cache, hidden)
        for i, g in enumerate(groups):
            if scored[i] and hidden is not None:
                g.prompt_lp = self._prompt_logprobs(g, hidden[i, : len(g.prompt)])
        if hidden is not None:
            self.speculation.take_in_prompts(b0, contexts, hidden)
        new, order = self.admission.place(
            groups, b0, lens, self.drafter is not None, self.speculation.eagle_cache
        )
        # Every sample draws its own first token from its prompt's last-position logits.
        row_logits = logits[torch.tensor(order, device=self.device)]
        toks, lps, tops = self._sample(new, row_logits)
        done: dict[int, FinishReason] = {}
        for r, s in enumerate(new):
            if hidden is not None:
                _keep_prompt_hidden(s, hidden[order[r]])
            reason = self.emission.emit(
                s, [toks[r]], [lps[r]], None, tops=tops[r] if tops else None
            )
            if reason is not None:
                done[b0 + r] = reason
        self.stats.first_tokens += len(new)
        self.stats.record_prefill(n_groups * width, time.perf_counter() - t0)
        return done

    @torch.inference_mode()
    def _prompt_logprobs(self, g: Group, hidden: Tensor) -> PromptLogprobs:
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

    def _decode(self) -> dict[int, FinishReason]:
        """One decode step of the running batch, speculative where the gate says so."""
        strategy = self.speculation.choose(self.policy_version)
        if strategy is None:
            return self._plain_step()
        return self.speculation.step(strategy)

    def _sample(
        self, seqs: Sequence[Seq], logits: Tensor
    ) -> tuple[list[int], list[float], list[list[TopLogprobs]] | None]:
        """Draw one token per row from logits [B, V]; returns tokens, their logprobs and the
        rows' top alternatives (rows.top_alternatives)."""
        params = row_params(seqs, self.device)
        logp = log_probs(logits, params)
        if params.all_greedy:
            tok = logp.argmax(dim=-1)
        else:
            pos = torch.tensor([[len(s.tokens)] for s in seqs], device=self.device)
            u = uniforms(row_keys(seqs, self.device), pos, SAMPLE)[:, 0]
            tok = sample_from(logp.exp(), u)
            if params.any_greedy:
                tok = torch.where(params.greedy, logp.argmax(dim=-1), tok)
        lp = token_logprobs(logits, logp, tok, params)
        tops = top_alternatives(seqs, logits[:, None], logp[:, None], params)
        return tok.tolist(), lp.tolist(), tops

    def _plain_step(self) -> dict[int, FinishReason]:
        t0 = time.perf_counter()
        seqs, lens = self.running, self.cache.lens
        b = len(seqs)
        tokens = torch.tensor([[s.tokens[-1]] for s in seqs], device=self.device)
        batch = Batch.make(lens[:b], None, 1, 0, self.cache.trash, self.device)
        need_hidden = self.speculation.hidden_needed(seqs)
        logits, hidden = self.model(
            tokens, self.cache, batch, last_only=True, return_hidden=need_hidden
        )
        toks, lps, tops = self._sample(seqs, logits)
        done: dict[int, FinishReason] = {}
        for i, s in enumerate(seqs):
            lens[i] += 1
            s.plain_steps += 1
            h = hidden[i] if hidden is not None else None
            reason = self.emission.emit(s, [toks[i]], [lps[i]], h, tops=tops[i] if tops else None)
            if reason is not None:
                done[i] = reason
        dt = time.perf_counter() - t0
        self.stats.record_plain_step(b, b, dt)
        if self.config.measured_gate and isinstance(self.bandit, BucketedEpsilonGreedy):
            self.bandit.record_plain(b, dt)
        return done

    def _finish(self, done: dict[int, FinishReason]) -> list[SampleOutput]:
        """Report finished rows and compact: the last running row moves into each freed slot."""
        self.emission.index_emitted()
        eagle_cache = self.speculation.eagle_cache
        out: list[SampleOutput] = []
        for slot in sorted(done, reverse=True):
            s = self.running[slot]
            out.append(sample_output(s, done[slot]))
            self.prefix.keep(s, self.cache, slot)
            last = len(self.running) - 1
            self.cache.move(last, slot)
            if eagle_cache is not None:
                eagle_cache.move(last, slot)
            self.running[slot] = self.running[last]
            self.running.pop()
            self.emission.leave(s)
        out.reverse()
        return out


def _checked(cfg: EngineConfig) -> EngineConfig:
    if cfg.spec_mode not in ("off", "adaptive", "fixed"):
        raise ValueError(f"spec_mode must be off|adaptive|fixed, got {cfg.spec_mode!r}")
    if cfg.gate not in ("measured", "threshold"):
        raise ValueError(f"gate must be measured|threshold, got {cfg.gate!r}")
    return cfg


def gate_for(
    cfg: EngineConfig, earlier: GateState | None
) -> tuple[BucketedEpsilonGreedy | FixedStrategy, GateState | None]:
    """The bandit that picks each decode step's arm, and what the gate learns (None in the
    fixed mode); `earlier` is continued when it fits (same strategies and buckets)."""
    if cfg.spec_mode == "fixed":
        return FixedStrategy(cfg.strategies[0]), None
    buckets = cfg.bucket_sizes()
    if earlier is None or not earlier.fits(cfg.strategies, buckets, cfg.measured_gate):
        earlier = GateState(
            BucketedEpsilonGreedy(
                cfg.strategies,
                buckets,
                cfg.epsilon,
                cfg.window,
                cfg.seed,
                plain_arm=cfg.measured_gate,
                explore_margin=cfg.explore_margin,
            )
        )
    return earlier.bandit, earlier


def _with_restored(hidden: Tensor, restored: list[Tensor | None], fed: list[int]) -> Tensor:
    """A prefill's hidden states [group, fed position, H] with each group's restored positions'
    (prefix_cache.py) put in front: [group, context position, H]."""
    rows = [
        torch.cat([h, hidden[i, : fed[i]]]) if h is not None else hidden[i, : fed[i]]
        for i, h in enumerate(restored)
    ]
    out = hidden.new_zeros(len(rows), max(r.shape[0] for r in rows), hidden.shape[-1])
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def _keep_prompt_hidden(s: Seq, hidden: Tensor) -> None:
    """A new sample keeps its prompt's hidden states [>= len(prompt), H] where it returns them
    (or a later drafter version must catch up on them); for the EAGLE drafter, which has read
    the prompt's own pairs at prefill (Speculation.take_in_prompts), only the last position's,
    whose next token is the sample's first."""
    n = len(s.group.context)
    # Copies, of only what each keeps: a view would keep the whole batch's hidden tensor alive.
    if s.history is not None:
        s.history.append(hidden[:n].clone())
    if s.eagle_ok:
        s.eagle_hidden.append(hidden[n - 1 : n].clone())
