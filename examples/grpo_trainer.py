"""A small GRPO trainer for the demo: group-normalised advantages, clipped policy-gradient loss
over the HF policy's recomputed logprobs, and Hugging Face checkpoints to push to tltd."""

from __future__ import annotations

import copy
import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Scored:
    """One rollout sample as the trainer uses it."""

    prompt_ids: list[int]
    token_ids: list[int]
    rollout_logprobs: list[float]  # what the daemon's target said when it sampled them
    reward: float
    advantage: float = 0.0
    # 1 where the policy sampled the token, 0 where the environment wrote it (a multi-turn
    # session's tool output: in the context, never trained on); None: every token sampled.
    loss_mask: list[int] | None = None


@dataclass(frozen=True)
class UpdateStats:
    loss: float
    samples_used: int  # samples with a non-zero advantage (the others carry no gradient)
    tokens: int
    clipped_fraction: float
    # max |trainer logprob - rollout logprob| before the update: ~0 when the daemon returned
    # the current policy's logprobs, as it must (same weights, temperature 1).
    max_logprob_gap: float
    grad_norm: float


def group_advantages(rewards: Sequence[Sequence[float]], eps: float = 1e-6) -> list[list[float]]:
    """GRPO advantages: each reward minus its group's mean, over the group's std (n - 1).

    A group whose rewards are all equal (all right or all wrong) says nothing about which
    answer is better: its advantages are 0, not 0/0.
    """
    out = []
    for group in rewards:
        g = [float(r) for r in group]
        mean = sum(g) / len(g)
        var = sum((r - mean) ** 2 for r in g) / (len(g) - 1) if len(g) > 1 else 0.0
        std = math.sqrt(var)
        out.append([0.0 if std < eps else (r - mean) / (std + eps) for r in g])
    return out


def clipped_pg_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip: float,
    token_level: bool = False,
) -> tuple[Tensor, Tensor]:
    """PPO/GRPO clipped surrogate: averaged over each sample's tokens and summed over samples
    (GRPO's form), or with `token_level` summed over every token (DAPO's form).

    All arguments are [B, T] (advantages broadcast per sample); the caller divides by the
    number of samples (or, token-level, of tokens) in the whole batch. Returns (loss,
    clipped-token mask).
    ratio = p_new / p_rollout; with one update per rollout it starts at 1, so the gradient is
    the plain policy gradient A * grad log p, and clipping only matters if weights drift.
    """
    return clipped_surrogate(
        torch.exp(logprobs - old_logprobs), advantages, mask, clip, token_level
    )


def clipped_surrogate(
    ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip: float,
    token_level: bool,
    weight: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """-min(r A, clip(r) A) per token (times `weight`, when given), reduced as
    `clipped_pg_loss` says; returns (loss, clipped-token mask)."""
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip, 1 + clip) * advantages
    per_token = -torch.minimum(unclipped, clipped) * mask
    if weight is not None:
        per_token = per_token * weight
    if token_level:
        return per_token.sum(), (unclipped != clipped) & mask.bool()
    per_sample = per_token.sum(-1) / mask.sum(-1).clamp(min=1)
    return per_sample.sum(), (unclipped != clipped) & mask.bool()


class GRPOTrainer:
    """The policy being trained (transformers Qwen2ForCausalLM on CPU) and its optimizer."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        lr: float = 5e-5,
        clip: float = 0.2,
        max_grad_norm: float = 1.0,
        micro_batch_tokens: int = 1024,
        seed: int = 0,
        token_level: bool = False,
        kl_coef: float = 0.0,
    ) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.source = Path(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.train()
        self.pad_id = int(self.model.config.pad_token_id or 0)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.clip = clip
        # The surrogate (clipped_pg_loss's signature): the asynchronous run sets a decoupled one
        # (examples/async_grpo.py) that weighs stale tokens by proximal / behaviour probability.
        self.pg_loss = clipped_pg_loss
        self.max_grad_norm = max_grad_norm
        self.micro_batch_tokens = micro_batch_tokens
        # Token-level loss (DAPO): every token of the batch weighs the same. The per-sample
        # mean weighs a token of a long answer less than one of a short answer, so a long
        # wrong answer is punished less per token than a short one and lengths drift up
        # (the length bias Dr. GRPO describes).
        self.token_level = token_level
        # GRPO's KL penalty towards the initial policy (k3 estimator, per token, weighed as the
        # policy-gradient loss is): keeps what the reward does not single out (e.g. arithmetic
        # that was right) where it was, while the advantage moves what it does.
        self.kl_coef = kl_coef
        self.reference = None
        if kl_coef > 0:
            self.reference = copy.deepcopy(self.model).eval()  # the weights as loaded
            self.reference.requires_grad_(False)

    def _micro_batches(self, batch: list[Scored]) -> list[list[Scored]]:
        # Sorted by length so that short and long samples do not share padding. Small
        # micro-batches pad less and attend over shorter rows: on the demo's 128 long-tailed
        # samples (12k output tokens, 2 CPU threads) an update took 6.7-8.2 s at 1,024
        # tokens per micro-batch, 9.1-10.7 s at 4,096 and 15-18 s at 16,384. The gradient is
        # the same sum whatever the split.
        ordered = sorted(batch, key=lambda s: len(s.prompt_ids) + len(s.token_ids))
        out: list[list[Scored]] = []
        current: list[Scored] = []
        for s in ordered:
            width = len(s.prompt_ids) + len(s.token_ids)
            if current and width * (len(current) + 1) > self.micro_batch_tokens:
                out.append(current)
                current = []
            current.append(s)
        if current:
            out.append(current)
        return out

    def token_logprobs(self, group: list[Scored], model=None) -> tuple[Tensor, Tensor]:
        """Logprobs of each sample's output tokens under the current weights (or `model`'s):
        ([B, T], mask)."""
        width = max(len(s.prompt_ids) + len(s.token_ids) for s in group)
        out_len = max(len(s.token_ids) for s in group)
        ids = torch.full((len(group), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(group), width), dtype=torch.long)
        for row, s in enumerate(group):
            seq = s.prompt_ids + s.token_ids
            ids[row, : len(seq)] = torch.tensor(seq)
            attn[row, : len(seq)] = 1
        logits = (model or self.model)(input_ids=ids, attention_mask=attn).logits.float()
        logp_all = torch.log_softmax(logits, dim=-1)
        lp = torch.zeros((len(group), out_len))
        mask = torch.zeros((len(group), out_len))
        for row, s in enumerate(group):
            p, t = len(s.prompt_ids), len(s.token_ids)
            # Position i predicts token i + 1: output token j sits at p + j, predicted at p+j-1.
            targets = torch.tensor(s.token_ids)
            rows = logp_all[row, p - 1 : p - 1 + t]
            lp[row, :t] = rows.gather(-1, targets[:, None])[:, 0]
            mask[row, :t] = 1 if s.loss_mask is None else torch.tensor(s.loss_mask[:t])
        return lp, mask

    def _kl(self, group: list[Scored], lp: Tensor, mask: Tensor) -> Tensor:
        """k3 estimate of KL(policy || reference) on the group's tokens, summed over samples of
        per-sample means (token-level: summed over tokens), as the policy loss is."""
        with torch.no_grad():
            ref, _ = self.token_logprobs(group, self.reference)
        per_token = (torch.exp(ref - lp) - (ref - lp) - 1) * mask
        if self.token_level:
            return per_token.sum()
        return (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).sum()

    @torch.no_grad()
    def logprob_gap(self, batch: list[Scored]) -> float:
        """max |trainer logprob - rollout logprob| over the batch's output tokens: ~0 when the
        rollouts came from these weights at temperature 1 (the daemon returns the target's)."""
        gap = 0.0
        for group in self._micro_batches([s for s in batch if s.token_ids]):
            lp, mask = self.token_logprobs(group)
            for row, s in enumerate(group):
                old = torch.tensor(s.rollout_logprobs)
                diff = (lp[row, : len(old)] - old).abs() * mask[row, : len(old)]
                gap = max(gap, float(diff.max()))
        return gap

    def update(self, batch: list[Scored]) -> UpdateStats:
        """One optimizer step on a scored rollout batch (samples with advantage 0 skipped)."""
        used = [s for s in batch if s.advantage != 0.0 and s.token_ids]
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, tokens, clipped, gap = 0.0, 0, 0, 0.0
        denominator = sum(len(s.token_ids) for s in used) if self.token_level else len(used)
        for group in self._micro_batches(used):
            lp, mask = self.token_logprobs(group)
            old = torch.zeros_like(lp)
            adv = torch.tensor([[s.advantage] for s in group])
            for row, s in enumerate(group):
                old[row, : len(s.rollout_logprobs)] = torch.tensor(s.rollout_logprobs)
            gap = max(gap, float(((lp.detach() - old).abs() * mask).max()))
            loss, clip_mask = self.pg_loss(lp, old, adv, mask, self.clip, self.token_level)
            if self.reference is not None:
                loss = loss + self.kl_coef * self._kl(group, lp, mask)
            (loss / denominator).backward()
            total_loss += float(loss.detach())
            tokens += int(mask.sum())
            clipped += int(clip_mask.sum())
        grad_norm = 0.0
        if used:
            grad_norm = float(
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            )
            self.optimizer.step()
        return UpdateStats(
            loss=total_loss / max(1, denominator),
            samples_used=len(used),
            tokens=tokens,
            clipped_fraction=clipped / max(1, tokens),
            max_logprob_gap=gap,
            grad_norm=grad_norm,
        )

    def save(self, out_dir: str | Path) -> Path:
        """A Hugging Face checkpoint directory (config, safetensors, tokenizer) for UpdatePolicy."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(out), safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (self.source / name).exists():
                shutil.copy2(self.source / name, out / name)
        return out
