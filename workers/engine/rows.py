"""The engine's rows: a running sample (`Seq`), the prompt it answers (`Group`), and what a step
reads of a batch of them as tensors (sampling parameters, randomness keys, top alternatives)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tltd.domain import (
    LogprobMode,
    PromptLogprobs,
    Sample,
    SamplingParams,
    TokenProvenance,
    TopLogprobs,
)
from tltd_workers.engine.sampling import RowParams, returned_logprobs


@dataclass
class Group:
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
    # A sample resumed from its stored tokens (n = 1): what it had emitted, continued from
    # there; its prefill feeds the prompt and those tokens (`context`).
    restore: Sample | None = None
    # Tokens each sample may emit here before it pauses (ABORTED, a step's token budget: it
    # goes on later from its stored tokens); 0 = no budget.
    pause_after: int = 0
    # Its sample's KV is kept after it finishes and reused by a later request with the same
    # key (prefix_cache.py); "" = neither. `kv_epoch`: the weights its prefill ran on.
    cache_key: str = ""
    kv_epoch: int = -1
    # A session's first prompt: its KV is kept under this key at prefill too, for the other
    # sessions of that prompt (a group) to reuse ("" = none). `reused`: positions restored.
    share_key: str = ""
    reused: int = 0

    @property
    def context(self) -> list[int]:
        """What the prefill feeds: the prompt, and a resumed sample's tokens so far."""
        return self.prompt + list(self.restore.token_ids) if self.restore else self.prompt


class Seq:
    """A running sample: its emitted tokens and the bookkeeping of its cache rows."""

    __slots__ = (
        "group",
        "index",
        "key",
        "tokens",
        "logprobs",
        "stop",
        "max_new",
        "pauses",
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

    def __init__(self, group: Group, index: int, key: int, max_new: int) -> None:
        self.group = group
        self.index = index
        self.key = key
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.stop = frozenset(group.sampling.stop_token_ids)
        self.max_new = max_new
        self.pauses = False  # max_new is a step's token budget: reaching it pauses the sample
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


def row_params(seqs: Sequence[Seq], device: torch.device) -> RowParams:
    """The rows' sampling parameters as tensors."""
    ss = [s.group.sampling for s in seqs]
    return RowParams.make(
        [p.temperature for p in ss],
        [p.top_k for p in ss],
        [p.top_p for p in ss],
        device,
        raw=[p.logprob_mode is LogprobMode.RAW for p in ss],
    )


def row_keys(seqs: Sequence[Seq], device: torch.device) -> Tensor:
    """The rows' randomness keys [B] (sampling.row_key)."""
    return torch.tensor([s.key for s in seqs], dtype=torch.long, device=device)


def top_alternatives(
    seqs: Sequence[Seq], logits: Tensor, logp: Tensor, params: RowParams
) -> list[list[TopLogprobs]] | None:
    """Per row, per position of logits [B, W, V], the top alternatives the row asked for
    ([] for a row that did not ask), read from the target distribution its logprobs refer
    to; None, at no cost, when no row asked."""
    wants = [s.group.sampling.top_logprobs for s in seqs]
    k = min(max(wants), logits.shape[-1])
    if k <= 0:
        return None
    rows = [r for r, n in enumerate(wants) if n > 0]
    at = torch.tensor(rows, device=logits.device)
    dist = returned_logprobs(logits[at], logp[at], _select(params, at))
    vals, ids = dist.topk(k, dim=-1)
    out: list[list[TopLogprobs]] = [[] for _ in seqs]
    for r, v, i in zip(rows, vals.tolist(), ids.tolist(), strict=True):
        n = wants[r]
        out[r] = [TopLogprobs(tuple(a[:n]), tuple(b[:n])) for b, a in zip(v, i, strict=True)]
    return out


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
