"""Speculation: the gate's arm for each decode step, the drafts (n-gram, history, EAGLE), one
verify pass over every row's drafts, and the lossless accept rule's result into the samples."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from tltd.domain import FinishReason, TopLogprobs
from tltd_workers.engine.bandit import BucketedEpsilonGreedy, FixedStrategy, Strategy
from tltd_workers.engine.costs import CostModel, expected_tokens, fallback_pays
from tltd_workers.engine.datatypes import EngineConfig
from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.engine.emission import Emission
from tltd_workers.engine.gate import GateState, arm_priors, choose_arm
from tltd_workers.engine.history import HistoryDrafter
from tltd_workers.engine.kv_cache import KVCache
from tltd_workers.engine.ngram import NgramDrafter
from tltd_workers.engine.rows import Seq, row_keys, row_params, top_alternatives
from tltd_workers.engine.sampling import (
    SAMPLE,
    RowParams,
    log_probs,
    sample_from,
    token_logprobs,
    uniforms,
)
from tltd_workers.engine.spec import accept_drafts
from tltd_workers.engine.stats import EngineStats, step_provenance
from tltd_workers.engine.transformer import Batch, CausalLM

# An EAGLE step whose rows have more than this many drafts' worth ((k + 1) positions each) of
# positions the drafter has not seen catches up on them first (Speculation._eagle_drafts).
CATCH_UP_BACKLOG = 2
# The history arm drafts a row from its prompt's history where the history offers at least
# this many tokens (a shorter walk means a rare or contested continuation) and from the EAGLE
# drafter elsewhere, in the same verify pass (where that pays: costs.fallback_pays).
HISTORY_MIN_DRAFT = 4


@dataclass
class _Proposal:
    """A step's drafts: per row the tokens, how many of them to verify and which drafter
    proposed them."""

    drafts: list[list[int]]
    dlen: list[int]
    kinds: list[str]


@dataclass
class _Verified:
    """A verify pass's outcome per row: drafts accepted, then what it emits (the accepted
    drafts + the target's own token), their logprobs, hidden states and top alternatives."""

    accepted: list[int]
    emitted: list[list[int]]
    logprobs: list[list[float]]
    hidden: Tensor | None
    tops: list[list[TopLogprobs]] | None


class Speculation:
    """The speculative decode step over the running batch (`running[i]` in cache slot i), and
    the EAGLE drafter it drafts with (`set_drafter`)."""

    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM,
        cache: KVCache,
        running: list[Seq],
        *,
        ngram: NgramDrafter,
        history: HistoryDrafter | None,
        bandit: BucketedEpsilonGreedy | FixedStrategy,
        gate_state: GateState | None,
        costs: CostModel | None,
        stats: EngineStats,
        emission: Emission,
    ) -> None:
        self.config = config
        self.model = model
        self.cache = cache
        self.running = running
        self.device = torch.device(config.device)
        self.ngram = ngram
        self.history = history
        self.bandit = bandit
        self.gate_state = gate_state
        self.costs = costs
        self.stats = stats
        self.emission = emission
        self.drafter: EagleDrafter | None = None
        self.drafter_version = 0
        self.eagle_cache: KVCache | None = None
        # Draft length of EAGLE rows in a history step: the longest EAGLE arm (0: no fallback).
        self._eagle_k = max((st.k for st in config.strategies if st.drafter == "eagle"), default=0)
        self._catch_up_s = 0.0  # drafter catch-up time of the current SD step

    # -- the EAGLE drafter ----------------------------------------------------------------------

    def set_drafter(self, drafter: EagleDrafter | None, version: int) -> None:
        """Swap the EAGLE drafter (Engine.set_drafter); running rows that keep hidden states
        hand them to the new one."""
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

    def take_in_prompts(self, b0: int, prompts: list[list[int]], hidden: Tensor) -> None:
        """The drafter reads each new prompt once, into its leader's cache row b0 + i: the
        pairs (h_t, x_{t+1}) within the prompt, which all its n samples share (the admission
        then copies them to the samples' rows, as it does the target's KV). Each sample is left
        its last prompt position, whose next token it draws itself. Read per sample instead, a
        prompt cost n drafter passes over it in the first EAGLE step."""
        if self.drafter is None or self.eagle_cache is None:
            return
        rows = range(b0, b0 + len(prompts))
        for r in rows:
            self.eagle_cache.lens[r] = 0
        toks = [p[1:] for p in prompts]
        if any(toks):
            feats = [hidden[i, : len(t)] for i, t in enumerate(toks)]
            self.drafter.absorb(self.eagle_cache, feats, toks, row0=b0)

    def hidden_needed(self, seqs: Iterable[Seq]) -> bool:
        """Whether a forward over these rows must return the target's hidden states."""
        return self.drafter is not None or any(s.history is not None for s in seqs)

    # -- the gate -------------------------------------------------------------------------------

    def choose(self, policy_version: int) -> Strategy | None:
        """The SD gate: the strategy of the next decode step, None for a plain step."""
        cfg = self.config
        b = len(self.running)
        if cfg.spec_mode == "off" or not any(s.group.speculative for s in self.running):
            return None
        if not cfg.measured_gate and b > cfg.batch_threshold:
            return None
        available = {"ngram"}
        if self._history_ready():
            available.add("history")
        if self.drafter is not None and any(s.eagle_ok for s in self.running):
            available.add("eagle")
        return choose_arm(
            self.bandit,
            self.gate_state,
            self.costs,
            b,
            available,
            (policy_version, self.drafter_version),
        )

    def priors(self, batch_size: int) -> dict[str, float] | None:
        """Predicted tokens/s per arm at this batch size's bucket (None: no cost model there)."""
        return arm_priors(self.costs, self.gate_state, batch_size)

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

    # -- the step -------------------------------------------------------------------------------

    def step(self, strategy: Strategy) -> dict[int, FinishReason]:
        """Draft up to k tokens per row, verify all rows in one target forward, accept/reject;
        returns the slots whose samples finished and why."""
        t0 = time.perf_counter()
        b = len(self.running)
        params = row_params(self.running, self.device)
        self._catch_up_s = 0.0
        proposal = self._propose(strategy, params)
        t1 = time.perf_counter()
        verified = self._verify(proposal, params)
        if self.gate_state is not None:  # acceptance as drafted, before stop-token clipping
            self._observe(proposal.kinds, proposal.dlen, verified.accepted)
        done, gained, kept = self._emit_rows(proposal, verified)
        t2 = time.perf_counter()
        # Over all rows: the reward is the step's throughput (every row's tokens per second, as
        # the plain arm's b / dt is), and rows that drafted nothing still cost and gain in it.
        # A drafter catch-up is left out: charged to the one step that ran it, it would make
        # EAGLE's first step after a plain run look many times slower than EAGLE is.
        self.bandit.record(b, strategy, sum(gained) / b, t2 - t0 - self._catch_up_s)
        self.stats.record_spec_step(
            b, strategy, proposal.dlen, kept, gained, t1 - t0, t2 - t1, proposal.kinds
        )
        return done

    def _verify(self, proposal: _Proposal, params: RowParams) -> _Verified:
        """One target forward over each row's pending token and drafts; the accept rule
        (spec.py) keeps each row's leading drafts that equal what plain decoding would emit,
        then emits plain decoding's token."""
        seqs, lens, b = self.running, self.cache.lens, len(self.running)
        dlen = proposal.dlen
        # Row i feeds its pending token + its dlen[i] drafts (padding to the widest row).
        width = 1 + max(dlen)
        rows = [
            [s.tokens[-1]] + d[:n] + [0] * (width - 1 - n)
            for s, d, n in zip(seqs, proposal.drafts, dlen, strict=True)
        ]
        tokens = torch.tensor(rows, device=self.device)
        batch = Batch.make(lens[:b], [1 + n for n in dlen], width, 0, self.cache.trash, self.device)
        logits, hidden = self.model(
            tokens, self.cache, batch, return_hidden=self.hidden_needed(seqs)
        )
        logp = log_probs(logits, params)  # [B, width, V]: p at every verified position
        keys = row_keys(seqs, self.device)
        base = torch.tensor([len(s.tokens) for s in seqs], device=self.device)
        pos = base[:, None] + torch.arange(width, device=self.device)[None, :]
        draft_t = tokens[:, 1:]
        n_acc, nxt = accept_drafts(
            logp.exp(),
            draft_t,
            batch.n_new - 1,
            params.greedy,
            uniforms(keys, pos, SAMPLE),
            logp.argmax(dim=-1),
        )
        # Row i emits draft[:n_i] + [next_i]; logprobs come from the target's p (or its raw
        # logits, for rows asking for raw logprobs).
        emitted = torch.cat([draft_t, torch.zeros_like(nxt)[:, None]], dim=1)
        emitted[torch.arange(b, device=self.device), n_acc] = nxt
        emitted_lp = token_logprobs(logits, logp, emitted, params)
        tops = top_alternatives(seqs, logits, logp, params)  # the target's alternatives
        return _Verified(n_acc.tolist(), emitted.tolist(), emitted_lp.tolist(), hidden, tops)

    def _emit_rows(
        self, proposal: _Proposal, verified: _Verified
    ) -> tuple[dict[int, FinishReason], list[int], list[int]]:
        """Each row's accepted drafts and the target's token into its sample. Returns the
        finished slots, the tokens each row emitted (fewer than n + 1 past a stop token) and
        the drafts each kept (drafts past a stop token do not count as accepted)."""
        lens = self.cache.lens
        done: dict[int, FinishReason] = {}
        gained: list[int] = []
        kept: list[int] = []
        for i, s in enumerate(self.running):
            n, drafted, kind = verified.accepted[i], proposal.dlen[i], proposal.kinds[i]
            lens[i] += 1 + n  # rejected positions past this are stale: the rollback
            if drafted:
                s.draft_steps += 1
                if kind == "eagle":
                    s.drafter_version = self.drafter_version
            else:  # nothing drafted (speculative=False, no EAGLE history, at its limit...):
                s.plain_steps += 1  # the verify pass was a plain decode step for this row
            h = verified.hidden[i] if verified.hidden is not None else None
            origin = step_provenance(n, drafted, kind) if s.provenance is not None else None
            top = verified.tops[i][: n + 1] if verified.tops else None
            before = len(s.tokens)
            toks, lps = verified.emitted[i][: n + 1], verified.logprobs[i][: n + 1]
            reason = self.emission.emit(s, toks, lps, h, origin, top)
            gained.append(len(s.tokens) - before)
            kept.append(min(n, gained[-1]))
            s.accepted += kept[-1]
            s.drafted += drafted
            if drafted and gained[-1] > kept[-1]:  # the target's own draw was emitted
                if n == drafted:
                    s.bonus += 1
                else:
                    s.residual += 1
            if reason is not None:
                done[i] = reason
        return done, gained, kept

    # -- the drafts -----------------------------------------------------------------------------

    def _propose(self, strategy: Strategy, params: RowParams) -> _Proposal:
        """Drafts per row, how many of them to verify and which drafter proposed each row."""
        seqs, k = self.running, strategy.k
        # Per-row budget: leave room for the target's own token within max_new_tokens (which
        # already includes the max_seq_len limit).
        cap = [min(k, s.max_new - len(s.tokens) - 1) if s.group.speculative else 0 for s in seqs]
        kinds = [strategy.drafter] * len(seqs)
        if strategy.drafter == "eagle":
            cap = [c if s.eagle_ok else 0 for c, s in zip(cap, seqs, strict=True)]
            drafts_t, confident = self._eagle_drafts(seqs, params, k)
            drafts = drafts_t.tolist()
            cap = [min(c, n) for c, n in zip(cap, confident, strict=True)]
        elif strategy.drafter == "history" and self.history is not None:
            drafts = self._history_drafts(seqs, cap, params, kinds)
        else:
            drafts = [
                self.ngram.propose(s.group.group_key, s.sample_key, c) if c > 0 else []
                for s, c in zip(seqs, cap, strict=True)
            ]
        dlen = [min(len(d), c) for d, c in zip(drafts, cap, strict=True)]
        return _Proposal(drafts, dlen, kinds)

    def _history_drafts(
        self, seqs: list[Seq], cap: list[int], params: RowParams, kinds: list[str]
    ) -> list[list[int]]:
        """The history arm: each row's walk over its prompt's history; rows whose walk is
        shorter than HISTORY_MIN_DRAFT take EAGLE drafts instead (`kinds` marks them), when a
        drafter is loaded and the bucket's costs say that pays (`_fallback_pays`); otherwise
        they keep their short walks. EAGLE runs only when some row needs it."""
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
            return drafts
        k = min(self._eagle_k, max(cap))
        if not self._fallback_pays(seqs, drafts, cap, fallback, k):
            return drafts
        eagle_t, confident = self._eagle_drafts(seqs, params, k)
        eagle = eagle_t.tolist()
        for i in fallback:
            drafts[i] = eagle[i][: min(cap[i], confident[i])]
            kinds[i] = "eagle"
        return drafts

    def _fallback_pays(
        self, seqs: list[Seq], drafts: list[list[int]], cap: list[int], fallback: list[int], k: int
    ) -> bool:
        """Whether EAGLE drafts for the `fallback` rows of a history step are worth their
        cost (`costs.fallback_pays`, on this bucket's measured costs and the gate's
        acceptance estimates); True where nothing is measured yet."""
        if self.costs is None or self.gate_state is None:
            return True
        b = len(drafts)
        bucket = self.gate_state.bandit.bucket(b)
        cost = self.costs.buckets.get(bucket)
        if cost is None:
            return True
        acceptance = self.gate_state.acceptance
        alpha = acceptance["history"].alpha
        skip = set(fallback)
        walks = [
            n
            for i, (d, c) in enumerate(zip(drafts, cap, strict=True))
            if i not in skip and (n := min(len(d), c))
        ]
        return fallback_pays(
            cost,
            bucket,
            b,
            history_rows=len(walks),
            history_tokens=sum(expected_tokens(alpha, 1.0, n) for n in walks),
            history_positions=sum(walks),
            fallback_rows=len(fallback),
            eagle_tokens=acceptance["eagle"].tokens_per_step(k),
            k=k,
            backlog_positions=sum(len(s.eagle_tokens) for s in seqs if s.eagle_ok),
        )

    def _observe(self, kinds: list[str], dlen: list[int], accepted: list[int]) -> None:
        """Acceptance per drafter: a history step's EAGLE rows count for EAGLE."""
        assert self.gate_state is not None
        for kind in dict.fromkeys(kinds):
            rows = [i for i, k in enumerate(kinds) if k == kind]
            self.gate_state.observe(kind, [dlen[i] for i in rows], [accepted[i] for i in rows])

    def _eagle_drafts(self, seqs: list[Seq], params: RowParams, k: int) -> tuple[Tensor, list[int]]:
        """EAGLE's drafts [B, k] and how many of each row's to verify. A sampled row's draft
        at a position is drawn from q with the uniform plain decoding draws that position's
        token with, so that the draft is kept whenever both draws agree (spec.py)."""
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
        u = None
        if not params.all_greedy:
            # The draws of all k positions at once (a pure function of key and position).
            keys = row_keys(seqs, self.device)
            base = torch.tensor([len(s.tokens) for s in seqs], device=self.device)
            u = uniforms(keys, base[:, None] + torch.arange(k, device=self.device), SAMPLE)

        def choose(logits: Tensor, i: int, confidence: bool) -> tuple[Tensor, Tensor | None]:
            logq = log_probs(logits, params)
            greedy_tok = logq.argmax(dim=-1)
            # Confidence = the largest drafter probability (EAGLE-2's estimate of a chain's
            # survival); any draft length keeps the output plain decoding's.
            conf = logq.max(dim=-1).values.exp() if confidence else None
            if u is None:
                return greedy_tok, conf
            drawn = sample_from(logq.exp(), u[:, i])
            return torch.where(params.greedy, greedy_tok, drawn), conf

        drafts, confident = self.drafter.propose(
            self.eagle_cache, feats, toks, k, choose, self.config.draft_confidence
        )
        for s in seqs:
            s.eagle_hidden, s.eagle_tokens = [], []
        return drafts, confident
