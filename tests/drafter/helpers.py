"""Tiny random Qwen2 targets saved with transformers, and rollout-like data for drafter tests."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.torch_device import torch_device
from tltd_workers.drafter.buffer import TrainingBuffer
from tltd_workers.drafter.forward import target_hidden
from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.engine.transformer import CausalLM, load_model


def make_target_dir(
    path: Path,
    *,
    vocab: int = 48,
    hidden: int = 32,
    layers: int = 2,
    seed: int = 0,
    logit_scale: float = 3.0,
) -> Path:
    """Save a random Qwen2 (HF format); logit_scale sharpens its distributions."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rope_theta=5000.0,
            tie_word_embeddings=True,
        )
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 1.0 / p.shape[1] ** 0.5)
            elif "bias" in name:
                p.normal_(0, 0.1)
        model.model.norm.weight.mul_(logit_scale)
    model.save_pretrained(path)
    return path


def load_target(path: Path, device: str | None = None) -> CausalLM:
    """On the suite's device (`pytest --device`) unless `device` says otherwise."""
    return load_model(path, dtype=torch.float32, device=device or torch_device())


def greedy_rollout(target: CausalLM, prompt: list[int], new_tokens: int) -> list[int]:
    """prompt + the target's greedy continuation (full prefill per token: tiny models only)."""
    ids = list(prompt)
    for _ in range(new_tokens):
        h = target_hidden(target, [torch.tensor(ids)])[0]
        ids.append(int(target.logits(h[-1]).argmax()))
    return ids


def rollout_samples(
    target: CausalLM, n: int, *, prompt_len: int = 4, new_tokens: int = 12, seed: int = 0
) -> list[tuple[list[int], int]]:
    """n (token ids, response_start) greedy samples from random prompts."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    out = []
    for _ in range(n):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        out.append((greedy_rollout(target, prompt, new_tokens), prompt_len))
    return out


def fill_buffer(
    buf: TrainingBuffer, target: CausalLM, samples, *, step: int = 0, version: int = 0
) -> list[int]:
    ids = []
    for tokens, rs in samples:
        h = target_hidden(target, [torch.tensor(tokens)])[0] if buf.keep_hidden else None
        item = buf.add(tokens, rs, policy_version=version, step=step, hidden=h)
        assert item is not None
        ids.append(item.item_id)
    return ids


def new_drafter(target: CausalLM, seed: int = 0) -> EagleDrafter:
    return EagleDrafter.random_init(target, seed=seed)


def publish(store, job_id, drafter, held_out, *, policy_version, train_steps, loss, out_dir):
    """What a training round does: the trainer measures (worker side), the daemon records and
    decides (`tltd.drafter_training.versions`)."""
    from tltd.drafter_training.versions import active_drafter, record
    from tltd_workers.drafter.versions import measure

    measured = measure(
        drafter,
        held_out,
        active=active_drafter(store, job_id),
        policy_version=policy_version,
        train_steps=train_steps,
        loss=loss,
        out_dir=out_dir,
    )
    return record(store, job_id, measured)
