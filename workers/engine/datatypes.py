"""The engine's public data types: its configuration, a request, a finished sample."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tltd.domain import (
    FinishReason,
    PromptLogprobs,
    Sample,
    SamplingParams,
    SpeculativeStats,
    TokenProvenance,
    TopLogprobs,
)
from tltd_workers.engine.bandit import Strategy

if TYPE_CHECKING:
    from tltd_workers.engine.engine_spec import EngineSpec

# The history drafter's drafts cost no forward pass and run long where a prompt's answers
# repeat, so its arms cap drafts at longer lengths (each row drafts only what its history
# supports, often less).
HISTORY_DRAFT_LENGTHS = (4, 8, 16)
DEFAULT_STRATEGIES = tuple(Strategy(d, k) for d in ("ngram", "eagle") for k in (2, 4, 6)) + tuple(
    Strategy("history", k) for k in HISTORY_DRAFT_LENGTHS
)


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 64
    max_seq_len: int = 2048  # prompt + generated tokens per sample
    spec_mode: str = "adaptive"  # "off" | "adaptive" (bandit) | "fixed" (strategies[0])
    # Where the adaptive mode speculates. "measured": in every bucket where speculation beats
    # plain decoding, predicted from decode costs measured on the device at start and then
    # measured per step (plain decoding is an arm of the bandit). "threshold": TLT's
    # reference rule, while the running batch is <= batch_threshold (an ablation; the
    # reference's 32 is a GPU setting). The fixed mode always uses the threshold.
    gate: str = "measured"
    batch_threshold: int = 32
    strategies: tuple[Strategy, ...] = DEFAULT_STRATEGIES
    epsilon: float = 0.1
    # With a cost model, exploration only tries arms whose estimate is within this fraction
    # of the best one's, so it costs at most epsilon x explore_margin of the throughput.
    explore_margin: float = 0.2
    window: int = 300
    buckets: tuple[int, ...] = ()  # () = bucket_sizes(): powers of two up to the gate's top
    # Wall seconds spent at start timing plain / verify / draft forwards per bucket (the
    # measured gate's cost model); 0 = none: the gate then tries every arm of a bucket
    # online, plain decoding first (TLT's BEG plus the plain arm).
    cost_budget_s: float = 2.0
    cost_context: int = 512  # positions per row while timing: a long-tail sequence's context
    # EAGLE rows verify only the drafts whose cumulative drafter confidence stays >= this
    # (at least one); 0 verifies all k. Verification is compute-bound on CPUs, so drafts that
    # would likely be rejected cost real time there.
    draft_confidence: float = 0.0
    ngram_max_match: int = 8
    ngram_min_match: int = 2
    # The history drafter's bound (history.py): answer tokens held over all prompts (least
    # recently used prompts dropped first) and per prompt (oldest answers dropped first).
    history_max_tokens: int = 1 << 18
    history_max_prompt_tokens: int = 1 << 16
    max_prefill_tokens: int = 8192  # padded prompt tokens per prefill forward
    # KV of finished keyed samples (session turns) kept for the next request of the same key
    # (prefix_cache.py), least recently kept dropped first; 0 = none kept.
    prefix_cache_bytes: int = 256 << 20
    seed: int = 0
    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    @property
    def measured_gate(self) -> bool:
        """The adaptive mode with the measured gate: plain decoding is an arm of the bandit,
        its priors come from the cost model."""
        return self.spec_mode == "adaptive" and self.gate == "measured"

    def bucket_sizes(self) -> tuple[int, ...]:
        """`buckets`, or else the powers of two below the largest batch that may speculate
        (max_batch with the measured gate, batch_threshold otherwise) and that batch."""
        if self.buckets:
            return self.buckets
        top = self.max_batch if self.gate == "measured" else self.batch_threshold
        top = max(1, min(top, self.max_batch))
        return tuple(1 << i for i in range(top.bit_length()) if 1 << i < top) + (top,)

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> EngineConfig:
        """The engine settings a rollout worker was sent (`EngineSpec.for_job` maps a job's
        speculative config to those): one arm per drafter and distinct draft length."""
        drafters = ("ngram", "eagle", "history") if spec.drafter == "auto" else (spec.drafter,)
        if spec.drafter not in ("auto", "ngram", "eagle", "history"):
            raise ValueError(
                f"speculative.drafter must be auto|ngram|eagle|history, got {spec.drafter!r}"
            )
        strategies = tuple(
            Strategy(d, k)
            for d in drafters
            # a repeat is no second arm; history arms have lengths of their own
            for k in dict.fromkeys(HISTORY_DRAFT_LENGTHS if d == "history" else spec.draft_lengths)
        )
        return cls(
            max_batch=spec.max_batch,
            max_seq_len=spec.max_seq_len,
            spec_mode=spec.spec_mode,
            gate=spec.gate,
            batch_threshold=spec.batch_threshold,
            strategies=strategies,
            device=spec.device,
            seed=spec.seed,
            prefix_cache_bytes=spec.prefix_cache_bytes,
            cost_budget_s=spec.cost_budget_s,
        )


@dataclass(frozen=True)
class Request:
    """Input of `Engine.generate` (same fields as `Engine.add_request`)."""

    request_id: str
    prompt_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt_index: int = 0
    return_hidden_states: bool = False
    speculative: bool = True
    cache_key: str = ""  # Engine.add_request
    share_key: str = ""  # Engine.add_request


@dataclass(frozen=True)
class EngineLoad:
    """What an engine holds (a rollout worker's heartbeat reports it)."""

    samples: int  # waiting or running
    remaining_tokens: int  # predicted, before every held sample ends (Engine.load)


@dataclass
class SampleOutput:
    request_id: str
    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int = 0  # the policy version when the sample started
    drafter_version: int = 0  # the EAGLE drafter version that last drafted for it (0: none)
    draft_steps: int = 0  # SD steps in which it drafted at least one token
    plain_steps: int = 0  # decode steps that gave it one token without drafts (not the first)
    accepted_tokens: int = 0  # draft tokens accepted over all its SD steps
    hidden_states: Tensor | None = None
    drafted_tokens: int = 0  # draft tokens verified over all its SD steps
    bonus_tokens: int = 0  # drawn from p after a fully accepted chain
    residual_tokens: int = 0  # drawn from the residual after a rejected draft
    provenance: list[TokenProvenance] | None = None  # per token, when the request asked
    # (first token index, policy version) per version that produced its tokens when a new
    # policy was loaded while it ran; () = every token came from `policy_version`.
    policy_spans: tuple[tuple[int, int], ...] = ()
    top_logprobs: list[TopLogprobs] | None = None  # per token, when sampling.top_logprobs > 0
    prompt_logprobs: PromptLogprobs | None = None  # when sampling.prompt_logprobs is set
    reused_tokens: int = 0  # prompt positions restored from kept KV (prefix_cache.py)

    def to_domain(self) -> Sample:
        """The `tltd.domain.Sample` the daemon stores and streams (hidden states dropped)."""
        return Sample(
            request_id=self.request_id,
            prompt_index=self.prompt_index,
            sample_index=self.sample_index,
            token_ids=tuple(self.token_ids),
            logprobs=tuple(self.logprobs),
            finish_reason=self.finish_reason,
            policy_version=self.policy_version,
            drafter_version=self.drafter_version,
            speculative=SpeculativeStats(
                draft_steps=self.draft_steps,
                plain_steps=self.plain_steps,
                accepted_tokens=self.accepted_tokens,
                mean_accepted_length=self.mean_accepted_length,
                drafted_tokens=self.drafted_tokens,
                bonus_tokens=self.bonus_tokens,
                residual_tokens=self.residual_tokens,
            ),
            provenance=None if self.provenance is None else tuple(self.provenance),
            policy_spans=self.policy_spans,
            top_logprobs=None if self.top_logprobs is None else tuple(self.top_logprobs),
            prompt_logprobs=self.prompt_logprobs,
            # Only a sample that ran to its end is whole; a cancelled one keeps its tokens.
            partial=self.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH),
            reused_tokens=self.reused_tokens,
        )

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per SD step (accepted drafts + 1), 0 when it never speculated."""
        return (
            (self.accepted_tokens + self.draft_steps) / self.draft_steps
            if self.draft_steps
            else 0.0
        )
