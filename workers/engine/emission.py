"""Emission: a step's tokens into their sample (up to a stop token or the length limit), into
the n-gram and history drafters' corpora at the step's end, and a finished sample's output."""

from __future__ import annotations

import torch
from torch import Tensor

from tltd.domain import FinishReason, TokenProvenance, TopLogprobs
from tltd_workers.engine.datatypes import SampleOutput
from tltd_workers.engine.history import HistoryDrafter
from tltd_workers.engine.ngram import NgramDrafter
from tltd_workers.engine.rows import Seq
from tltd_workers.engine.stats import PLAIN_TOKEN


class Emission:
    """Appends emitted tokens to their samples and keeps the drafters' corpora in step.

    `ngram`: None when no n-gram arm is configured (indexing every emitted token costs Python
    time); `history`: None without a history arm.
    """

    def __init__(self, ngram: NgramDrafter | None, history: HistoryDrafter | None) -> None:
        self.ngram = ngram
        self.history = history
        # Tokens emitted this step, indexed at the step's end in (group, sample index) order:
        # the index keeps the last occurrence of an n-gram, and slot order depends on what
        # else is in the batch, so indexing in slot order would let other requests change a
        # seeded sample's drafts and thereby its tokens. The history is indexed the same way.
        self._ngram_pending: list[tuple[str, int, str, list[int]]] = []
        self._history_pending: list[tuple[str, int, Seq, list[int]]] = []

    def emit(
        self,
        s: Seq,
        toks: list[int],
        lps: list[float],
        hidden_rows: Tensor | None,
        origin: list[TokenProvenance] | None = None,
        tops: list[TopLogprobs] | None = None,
    ) -> FinishReason | None:
        """Append tokens (stopping early at a stop token or the length limit); `origin`:
        each token's provenance (None: plain draws); `tops`: each token's top alternatives."""
        reason, n = _append(s, toks, lps)
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
        if self.ngram is not None:
            self._ngram_pending.append((g.group_key, s.index, s.sample_key, s.tokens[-n:]))
        if self.history is not None:
            self._history_pending.append((g.group_key, s.index, s, s.tokens[-n:]))
        return reason

    def index_emitted(self) -> None:
        """Index the step's emitted tokens in the drafters, in a batch-independent order."""
        if self.ngram is not None:
            pending, self._ngram_pending = self._ngram_pending, []
            for group_key, _, sample_key, toks in sorted(pending, key=lambda p: (p[0], p[1])):
                self.ngram.extend(group_key, sample_key, toks)
        if self.history is not None:
            hist, self._history_pending = self._history_pending, []
            for _, _, s, toks in sorted(hist, key=lambda p: (p[0], p[1])):
                self.history.extend(s.group.history_key, s.answer_id, toks)

    def leave(self, s: Seq) -> None:
        """A finished sample leaves the drafters (its answer stays in the history)."""
        g = s.group
        if self.history is not None:
            self.history.finish(g.history_key, s.answer_id)
        if self.ngram is not None:
            self.ngram.remove_sequence(g.group_key, s.sample_key)
        g.live -= 1
        if g.live == 0 and self.ngram is not None:
            self.ngram.remove_group(g.group_key)


def _append(s: Seq, toks: list[int], lps: list[float]) -> tuple[FinishReason | None, int]:
    """Append tokens until a stop token or the length limit; returns why it stopped (None: it
    did not) and how many tokens were appended."""
    n = 0
    for t, lp in zip(toks, lps, strict=True):
        s.tokens.append(t)
        s.logprobs.append(lp)
        n += 1
        if t in s.stop:
            return FinishReason.STOP, n
        if len(s.tokens) >= s.max_new:
            return (FinishReason.ABORTED if s.pauses else FinishReason.LENGTH), n
    return None, n


def sample_output(s: Seq, reason: FinishReason, hidden: bool = True) -> SampleOutput:
    """What a finished sample reports (`hidden`: with its hidden states, when it keeps them)."""
    states = None
    if hidden and s.group.return_hidden and s.history is not None:
        # On the host: a finished sample crosses a process pipe to the training buffer.
        states = torch.cat(s.history)[: len(s.group.prompt) + len(s.tokens) - 1].cpu()
    g = s.group
    return SampleOutput(
        g.request_id,
        g.prompt_index,
        s.index,
        s.tokens,
        s.logprobs,
        reason,
        s.spans[0][1],  # the version that sampled its first token (a resumed one's earlier)
        s.drafter_version,
        s.draft_steps,
        s.plain_steps,
        s.accepted,
        states,
        drafted_tokens=s.drafted,
        bonus_tokens=s.bonus,
        residual_tokens=s.residual,
        provenance=s.provenance,
        policy_spans=tuple(s.spans) if len(s.spans) > 1 else (),
        top_logprobs=s.top,
        prompt_logprobs=g.prompt_lp,
        reused_tokens=g.reused,
    )
