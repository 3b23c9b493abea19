"""Sampling: the processed distribution (temperature, top-k, top-p) and counter-based randomness.

The *processed distribution* of a row is what its sampler draws from and what the returned
logprobs refer to (what an RL trainer's importance ratios need):

    sampled rows (temperature > 0): softmax(restrict(logits / temperature))
        where restrict keeps the top_k highest logits (top_k > 0), then the smallest set of
        most likely tokens whose probability reaches top_p, and sets the rest to -inf;
    greedy rows (temperature == 0): softmax(logits), unrestricted (the argmax is emitted).

A row with logprob mode "raw" still samples from its processed distribution; only the logprob
it returns is log_softmax(logits) at the drawn token (`token_logprobs`).

Randomness is counter-based: the uniform used for (row key, token position, purpose) is a
hash of those integers, so a sample's draws do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# Purpose of a uniform at a given token position: the token plain decoding draws there, which
# speculative decoding reproduces (spec.py) and EAGLE's sampled drafts are drawn with. Other
# purposes would take other values.
SAMPLE = 0

_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _signed(z: int) -> int:
    return z - (1 << 64) if z >= 1 << 63 else z


def row_key(seed: int, prompt_index: int, sample_index: int) -> int:
    """The randomness key of one sample (a signed int64)."""
    z = _splitmix64(seed & _MASK64)
    z = _splitmix64(z ^ (prompt_index & _MASK64))
    return _signed(_splitmix64(z ^ (sample_index & _MASK64)))


def _srl(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


_C1, _C2, _C3 = (_signed(c) for c in (0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B97F4A7C15))


def uniforms(keys: Tensor, positions: Tensor, purpose: int) -> Tensor:
    """Uniform [0, 1) float64 for keys [B] and positions [B, K] -> [B, K].

    splitmix64 of (key, position, purpose) in int64 arithmetic, which wraps modulo 2**64 on
    every torch backend; 53 random bits per draw.
    """
    z = keys[:, None] ^ (positions * _C3) ^ (purpose * _C2 + 0x632BE59BD9B4E019)
    z = (z ^ _srl(z, 30)) * _C1
    z = (z ^ _srl(z, 27)) * _C2
    z = z ^ _srl(z, 31)
    return _srl(z, 11).double() * (1.0 / (1 << 53))


@dataclass
class RowParams:
    """Per-row sampling parameters as tensors (built once per step)."""

    temperature: Tensor  # [B] float, 1.0 for greedy rows (their logprobs use T = 1)
    top_k: Tensor  # [B] long, 0 = off
    top_p: Tensor  # [B] float
    greedy: Tensor  # [B] bool
    all_greedy: bool
    any_greedy: bool
    restrict: bool  # some sampled row uses top_k or top_p
    # [B] bool: sampled rows that return raw logprobs; None when there is none (greedy rows'
    # processed logprobs are already log_softmax(logits)).
    raw: Tensor | None = None

    @classmethod
    def make(
        cls,
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        device: torch.device | str,
        raw: Sequence[bool] | None = None,
    ) -> RowParams:
        greedy = [t <= 0.0 for t in temperature]
        raw_rows = [r and not g for r, g in zip(raw, greedy, strict=True)] if raw else []
        restrict = any(
            not g and (k > 0 or p < 1.0) for g, k, p in zip(greedy, top_k, top_p, strict=True)
        )
        temps = [1.0 if g else t for g, t in zip(greedy, temperature, strict=True)]
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            restrict=restrict,
            raw=torch.tensor(raw_rows, device=device) if any(raw_rows) else None,
        )


def log_probs(logits: Tensor, params: RowParams) -> Tensor:
    """Log of the processed distribution (module docstring); logits [B, ..., V], float32."""
    b = logits.shape[0]
    shape = (b,) + (1,) * (logits.dim() - 1)
    x = logits.float() / params.temperature.view(shape)
    if params.restrict:
        x = _restrict(x, params, shape)
    return torch.log_softmax(x, dim=-1)


def token_logprobs(logits: Tensor, logp: Tensor, tokens: Tensor, params: RowParams) -> Tensor:
    """The logprob each row returns for its chosen tokens [B, ...] (logits [B, ..., V]).

    `logp` is log_probs(logits, params), gathered for processed rows; raw rows get
    log_softmax(logits) at the token, computed as logit - logsumexp only when some row asks.
    """
    lp = logp.gather(-1, tokens[..., None])[..., 0]
    if params.raw is None:
        return lp
    x = logits.float()
    raw = x.gather(-1, tokens[..., None])[..., 0] - torch.logsumexp(x, dim=-1)
    return torch.where(params.raw.view((-1,) + (1,) * (lp.dim() - 1)), raw, lp)


def returned_logprobs(logits: Tensor, logp: Tensor, params: RowParams) -> Tensor:
    """The whole distribution each row's returned logprobs refer to, [B, ..., V]: `logp`
    (log_probs(logits, params)), or log_softmax(logits) for raw rows. What top alternatives
    and prompt logprobs are read from, so that they agree with the sampled token's logprob."""
    if params.raw is None:
        return logp
    raw = torch.log_softmax(logits.float(), dim=-1)
    return torch.where(params.raw.view((-1,) + (1,) * (logp.dim() - 1)), raw, logp)


def _restrict(x: Tensor, params: RowParams, shape: tuple[int, ...]) -> Tensor:
    """Top-k then top-p (HF order) on tempered logits; greedy rows are left unrestricted."""
    v = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(v, device=x.device)
    k = torch.where(params.top_k > 0, params.top_k, v).clamp(max=v)
    drop = rank >= k.view(shape)
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p; keeps >= 1 token.
    before = probs.cumsum(dim=-1) - probs
    top_p = params.top_p.view(shape)
    drop = drop | ((before >= top_p) & (top_p < 1.0))
    drop = drop & ~params.greedy.view(shape)
    return x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def sample_from(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw: probs [N, V] (unnormalised ok), u [N] in [0, 1) -> token ids [N]."""
    cdf = probs.double().cumsum(dim=-1)
    x = u.to(cdf.dtype) * cdf[:, -1]
    # right=True: the first token whose cdf exceeds x, so a zero-probability token is never hit.
    idx = torch.searchsorted(cdf, x[:, None], right=True)[:, 0]
    return idx.clamp(max=probs.shape[-1] - 1)
