"""A checkpoint as both sides read it without torch: a Hugging Face config's model shape
(`ModelConfig.from_hf`), the tensors the torch engine loads for it (`hf_tensor_shapes`), and
whether a drafter checkpoint can be used. The daemon checks a checkpoint with these before a
worker loads it; the engine builds its model from the same `ModelConfig`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096

    @classmethod
    def from_hf(cls, cfg: Mapping[str, object]) -> ModelConfig:
        """From a HF config.json dict (qwen2 / llama); rope_theta from rope_parameters in v5."""
        model_type = str(cfg.get("model_type", "llama"))
        if model_type not in ("qwen2", "llama"):
            raise ValueError(f"unsupported model_type {model_type!r} (qwen2 or llama)")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        assert isinstance(rope, dict)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])  # type: ignore[arg-type]
        head_dim = cfg.get("head_dim") or hidden // heads
        return cls(
            vocab_size=int(cfg["vocab_size"]),  # type: ignore[arg-type]
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),  # type: ignore[arg-type]
            num_layers=int(cfg["num_hidden_layers"]),  # type: ignore[arg-type]
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),  # type: ignore[arg-type]
            head_dim=int(head_dim),  # type: ignore[arg-type]
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),  # type: ignore[arg-type]
            rope_theta=float(theta),  # type: ignore[arg-type]
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),  # type: ignore[arg-type]
        )


def hf_tensor_shapes(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """The HF-named tensors `load_weights` reads for `cfg` and their shapes, and which of them
    may be absent (an untied lm_head falls back to the embeddings). Lets a checkpoint be
    checked from its safetensors header alone, without loading it."""
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg.vocab_size, h),
    }
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        a = p + "self_attn."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            a + "q_proj.weight": (q, h),
            a + "k_proj.weight": (kv, h),
            a + "v_proj.weight": (kv, h),
            a + "o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if cfg.qkv_bias:
            shapes |= {a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)}
    # A tied model never reads lm_head; an untied one uses the embeddings when it is missing.
    return shapes, {"lm_head.weight"}


# A tensor only drafters trained before the layer lost its input norm have.
LEGACY_INPUT_NORM = "layer.input_layernorm.weight"


class IncompatibleDrafterCheckpoint(ValueError):
    """A drafter checkpoint whose tensors do not fit the current drafter architecture."""


def check_drafter_tensors(names: Iterable[str], source: object) -> None:
    """Refuse a checkpoint trained with an input norm on the drafter's layer.

    Dropping that weight silently is not safe: fc and attention were trained on normalized
    inputs, so the same weights without the norm draft differently (and worse). Loading it
    would also make the SGLang export inexact again. Such a drafter must be refitted.
    """
    if LEGACY_INPUT_NORM in set(names):
        raise IncompatibleDrafterCheckpoint(
            f"drafter checkpoint {source} has {LEGACY_INPUT_NORM!r}: it was trained with an "
            "input norm on its decoder layer, which this drafter's network does not have "
            "(EAGLE / SGLang layer 0 runs no input norm); its weights cannot be used without "
            "that norm. Refit it (scripts/fit_drafter.py) or train a new one online."
        )
