"""Tiny random HF checkpoints (Qwen2 / Llama) written to a temp dir, for engine tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def make_checkpoint(
    path: Path,
    arch: str = "qwen2",
    *,
    vocab: int = 64,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    tie: bool = True,
    seed: int = 0,
    logit_scale: float = 1.0,
    head_dim: int | None = None,
) -> Path:
    """Save a random model; logit_scale > 1 sharpens its distributions (peaked logits)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    kw = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        rope_theta=5000.0,
        tie_word_embeddings=tie,
    )
    if head_dim is not None:
        kw["head_dim"] = head_dim
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    else:
        model = LlamaForCausalLM(LlamaConfig(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Random weights (HF init is tiny) so outputs vary with context; biases too.
            if p.dim() > 1:
                p.normal_(0, 0.5 / p.shape[1] ** 0.5 * 2)
            elif "bias" in name:
                p.normal_(0, 0.1)
        model.model.norm.weight.mul_(logit_scale)
    model.save_pretrained(path)
    return path


def with_final_norm_changed(src: Path, dst: Path, seed: int) -> Path:
    """A copy of checkpoint `src` at `dst` whose final norm is randomly rescaled: a new policy
    that changes the logits and nothing the KV cache holds (the old KV is exactly what the new
    weights compute), for policy switches mid-sample."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    shutil.copyfile(src / "config.json", dst / "config.json")
    sd = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    norm = sd["model.norm.weight"]
    sd["model.norm.weight"] = norm * (1 + 2 * torch.randn(norm.shape, generator=g))
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def chi_square_p_value(counts, law) -> float:
    """Goodness of fit of observed outcome counts to an exact law (outcome -> probability),
    cells with fewer than 5 expected draws pooled; 0 for a draw the law forbids."""
    from scipy.stats import chisquare

    n = sum(counts.values())
    if any(law.get(c, 0.0) <= 0.0 for c in counts):
        return 0.0  # an outcome the exact law forbids (e.g. cut by top-p) was drawn
    big = [c for c, p in law.items() if p * n >= 5]  # pool the cells too rare for chi-square
    obs = [counts.get(c, 0) for c in big]
    exp = [law[c] * n for c in big]
    rest_obs, rest_exp = n - sum(obs), n - sum(exp)
    if rest_exp > 1e-9 * n:  # the pooled rare cells; absent when the big cells hold all mass
        obs.append(rest_obs)
        exp.append(rest_exp)
    elif rest_obs:
        return 0.0  # draws in cells that hold (numerically) no mass
    exp = [e * n / sum(exp) for e in exp]  # rounding: chisquare wants equal totals
    return chisquare(obs, exp).pvalue


def three_token_law(ckpt, context, vocab: int, temperature: float, top_p: float) -> dict:
    """P(t1, t2, t3) after `context` under the processed distribution (transformers, fp64),
    by enumeration of every prefix of the `vocab`-token model at `ckpt`."""
    import itertools

    from transformers import AutoModelForCausalLM
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64).eval()
    warp = [TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p)]

    def probs(prefixes):
        ids = torch.tensor([list(context) + list(p) for p in prefixes])
        with torch.no_grad():
            scores = model(ids).logits[:, -1]
        for w in warp:
            scores = w(ids, scores)
        return torch.softmax(scores, -1)

    p1, p2 = probs([()])[0], probs([(a,) for a in range(vocab)])
    pairs = list(itertools.product(range(vocab), repeat=2))
    law = {}
    for (a, b), row in zip(pairs, probs(pairs), strict=True):
        for c in range(vocab):
            law[(a, b, c)] = float(p1[a] * p2[a, b] * row[c])
    return law
