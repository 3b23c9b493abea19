"""Drafter versions: acceptance on held-out rollouts (a candidate measured against the active
version), SGLang export."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from tltd.contract.checkpoint import check_drafter_tensors
from tltd.contract.drafter_messages import ActiveDrafter, Measured
from tltd_workers.drafter.forward import chain_accepted_lengths, target_hidden
from tltd_workers.drafter.trainer import write_error
from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.engine.transformer import ModelConfig, read_state_dict


@dataclass(frozen=True)
class HeldOut:
    """A recent rollout sample kept out of training, to measure acceptance on."""

    token_ids: Tensor  # [T] prompt + response
    response_start: int
    hidden: Tensor | None = None  # [N <= T, H] target features; None: recomputed by prefill


class MeasureStopped(Exception):
    """A measurement given up between samples: the device is wanted back."""


def mean_accepted_length(
    drafter: EagleDrafter,
    held_out: Sequence[HeldOut],
    k: int = 4,
    should_stop: Callable[[], bool] = lambda: False,
) -> float:
    """Mean tokens per speculative step of the drafter's greedy k-chains over the held-out
    samples' response positions (1.0 = no draft ever accepted; k + 1 = all accepted).
    `should_stop` is asked between samples; True raises MeasureStopped."""
    p = next(drafter.parameters())
    lengths = []
    for s in held_out:
        if should_stop():
            raise MeasureStopped
        ids = torch.as_tensor(s.token_ids, dtype=torch.long)
        h = s.hidden if s.hidden is not None else target_hidden(drafter.target, [ids])[0]
        lengths.append(
            chain_accepted_lengths(drafter, h.to(p.device, p.dtype), ids, s.response_start, k)
        )
    allv = torch.cat(lengths) if lengths else torch.zeros(0)
    return float(allv.mean()) if allv.numel() else 0.0


def measure(
    drafter: EagleDrafter,
    held_out: Sequence[HeldOut],
    *,
    active: ActiveDrafter | None,
    policy_version: int,
    train_steps: int,
    loss: float,
    out_dir: str | Path,
    k: int = 4,
    should_stop: Callable[[], bool] = lambda: False,
) -> Measured:
    """Save the drafter and measure it against the active version on the same held-out samples.

    The active version is re-measured here, since acceptance measured on older data is not
    comparable; with no active learned drafter the baseline is 1.0 token per step. Whether the
    candidate is promoted is the daemon's decision (`tltd.drafter_training.versions.record`).
    Each sample's target features are computed once for both drafters. `should_stop` is asked
    between samples: True removes what was saved and raises MeasureStopped.
    """
    path = Path(out_dir) / f"drafter-p{policy_version}-s{train_steps}-{uuid.uuid4().hex[:8]}"
    was_training = drafter.training
    drafter.eval()
    try:
        try:
            drafter.save_pretrained(path)
        except (OSError, SafetensorError) as exc:  # a full disk: nothing half-written is kept
            shutil.rmtree(path, ignore_errors=True)
            raise write_error(exc, f"drafter version not written to {path}") from exc
        held = _with_features(drafter, held_out, should_stop)
        acceptance = mean_accepted_length(drafter, held, k, should_stop)
        base, against = 1.0, "no learned drafter"
        if active is not None:
            against = f"active version {active.version}"
            try:
                old = EagleDrafter.from_pretrained(active.path, drafter.target)
                base = mean_accepted_length(old, held, k, should_stop)
            except (FileNotFoundError, OSError, ValueError):
                # Its checkpoint is gone or unreadable: fall back to its recorded acceptance.
                base, against = active.recorded_acceptance, f"{against} (recorded)"
    except MeasureStopped:
        shutil.rmtree(path, ignore_errors=True)
        raise
    finally:
        drafter.train(was_training)
    return Measured(
        path=str(path),
        policy_version=policy_version,
        train_steps=train_steps,
        loss=float(loss),
        acceptance=acceptance,
        baseline=base,
        against=against,
        held_out=len(held_out),
        k=k,
    )


def _with_features(
    drafter: EagleDrafter, held_out: Sequence[HeldOut], should_stop: Callable[[], bool]
) -> list[HeldOut]:
    """The held-out samples with their target features (one prefill each, shared by the
    drafters measured on them)."""
    out = []
    for s in held_out:
        if should_stop():
            raise MeasureStopped
        if s.hidden is None:
            ids = torch.as_tensor(s.token_ids, dtype=torch.long)
            s = HeldOut(ids, s.response_start, target_hidden(drafter.target, [ids])[0])
        out.append(s)
    return out


# -- export for SGLang ---------------------------------------------------------------------------

EAGLE_ARCHITECTURES = {"llama": "LlamaForCausalLMEagle", "qwen2": "Qwen2ForCausalLMEagle"}


@dataclass(frozen=True)
class ExportResult:
    path: Path
    notes: tuple[str, ...] = ()


def export_sglang(
    drafter_dir: str | Path,
    target_dir: str | Path,
    out_dir: str | Path,
    *,
    include_embeddings: bool = True,
) -> ExportResult:
    """Write a drafter version as a standalone EAGLE checkpoint for SGLang's
    `LlamaForCausalLMEagle` / `Qwen2ForCausalLMEagle` (speculative-algorithm EAGLE), exactly.

    SGLang's EAGLE model (python/sglang/srt/models/llama_eagle.py, qwen2_eagle.py, after
    EAGLE's cnets.py) computes: x = fc(cat(embed_tokens(ids), hidden)); one decoder layer whose
    input_layernorm is the identity (layer 0); out = hidden + residual, no final norm; logits
    from the target's lm_head. Its loader prefixes every checkpoint name with "model." and
    skips names containing "lm_head". Our drafter is the same network (its layer has no input
    norm either), so the export only renames, splits and reorders tensors (the mapping is in
    `_sglang_tensors`).

    config.json is the target's HF config with architectures=[<Eagle class>] and
    num_hidden_layers=1. A checkpoint trained with an input norm on the layer (older drafters)
    is refused with `IncompatibleDrafterCheckpoint`: without that norm it is another network.
    tests/drafter/test_versions.py runs the export through a reference of SGLang's forward.
    """
    drafter_dir, target_dir, out = Path(drafter_dir), Path(target_dir), Path(out_dir)
    ours = load_file(str(drafter_dir / "model.safetensors"))
    check_drafter_tensors(ours, drafter_dir)
    cfg = ModelConfig(**json.loads((drafter_dir / "config.json").read_text())["target"])
    hf_cfg = json.loads((target_dir / "config.json").read_text())
    model_type = str(hf_cfg.get("model_type", "llama"))
    if model_type not in EAGLE_ARCHITECTURES:
        raise ValueError(f"no SGLang EAGLE architecture for model_type {model_type!r}")
    tensors = _sglang_tensors(ours, cfg, drafter_dir)
    if include_embeddings:
        target_sd = read_state_dict(target_dir)
        tensors["embed_tokens.weight"] = target_sd["model.embed_tokens.weight"]
    dtype = next(iter(ours.values())).dtype
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    cfg_out = _sglang_config(hf_cfg, model_type, dtype)
    (out / "config.json").write_text(json.dumps(cfg_out, indent=2))
    return ExportResult(out)


def _sglang_config(hf_cfg: dict, model_type: str, dtype: torch.dtype) -> dict:
    """The target's HF config as a one-layer EAGLE model's."""
    cfg_out = dict(hf_cfg)
    cfg_out.update(
        architectures=[EAGLE_ARCHITECTURES[model_type]],
        num_hidden_layers=1,
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    if isinstance(cfg_out.get("layer_types"), list):  # per-layer lists follow the layer count
        cfg_out["layer_types"] = cfg_out["layer_types"][:1]
    return cfg_out


def _sglang_tensors(
    ours: dict[str, Tensor], cfg: ModelConfig, drafter_dir: Path
) -> dict[str, Tensor]:
    """Our drafter's tensors under SGLang's EAGLE names; a tensor the mapping does not know is
    refused, not dropped. The mapping (`export_sglang` adds the embeddings):

      ours (drafter model.safetensors)    -> SGLang EAGLE checkpoint
      fc.weight [H, 2H]                   -> fc.weight with its column halves swapped: we
                                             compute fc([hidden; embed]), SGLang fc([embed;
                                             hidden])
      fc.bias                             -> fc.bias
      layer.qkv.weight / .bias            -> layers.0.self_attn.{q,k,v}_proj.weight / .bias
                                             (rows split nq*hd, nkv*hd, nkv*hd; bias: qwen2)
      layer.o_proj.weight                 -> layers.0.self_attn.o_proj.weight
      layer.gate_up.weight                -> layers.0.mlp.{gate,up}_proj.weight (row halves)
      layer.down_proj.weight              -> layers.0.mlp.down_proj.weight
      layer.post_attention_layernorm.weight -> layers.0.post_attention_layernorm.weight
      (no input norm)                     -> (no layers.0.input_layernorm.weight: SGLang runs
                                             identity there)
      target model.embed_tokens.weight    -> embed_tokens.weight (if include_embeddings; SGLang
                                             also shares the target's at load time)
      target lm_head                      -> never written (SGLang uses the target's)
    """
    H = cfg.hidden_size
    tensors: dict[str, Tensor] = {
        "fc.weight": torch.cat([ours["fc.weight"][:, H:], ours["fc.weight"][:, :H]], dim=1),
        "fc.bias": ours["fc.bias"],
    }
    used = {"fc.weight", "fc.bias"}
    p = "layers.0."
    sizes = [
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
    ]
    for kind in ("weight", "bias"):
        if f"layer.qkv.{kind}" in ours:
            used.add(f"layer.qkv.{kind}")
            for n, t in zip("qkv", ours[f"layer.qkv.{kind}"].split(sizes), strict=True):
                tensors[f"{p}self_attn.{n}_proj.{kind}"] = t
    gate, up = ours["layer.gate_up.weight"].chunk(2, dim=0)
    tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"] = gate, up
    renames = {
        "layer.o_proj.weight": p + "self_attn.o_proj.weight",
        "layer.down_proj.weight": p + "mlp.down_proj.weight",
        "layer.post_attention_layernorm.weight": p + "post_attention_layernorm.weight",
    }
    for src, dst in renames.items():
        tensors[dst] = ours[src]
    used |= {"layer.gate_up.weight", *renames}
    if set(ours) - used:  # a tensor the mapping does not know would be lost silently
        raise ValueError(
            f"drafter checkpoint {drafter_dir} has tensors the SGLang export "
            f"does not map: {sorted(set(ours) - used)}"
        )
    return tensors
