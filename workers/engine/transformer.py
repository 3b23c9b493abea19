"""Llama/Qwen2-family decoder in plain torch, run over a ragged batch against a KV cache."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

from tltd.contract.checkpoint import ModelConfig
from tltd_workers.engine.kv_cache import KVCache


@dataclass
class Batch:
    """Per-forward metadata shared by all layers: where each row's new tokens go and see.

    Row b of the batch is cache slot row0 + b; it already holds lens[b] positions and brings
    n_new[b] <= T new tokens (the rest of its T columns is padding).

    A ragged batch (some row brings fewer than T tokens, e.g. verification of drafts of
    different lengths) is *packed*: the projections and the MLP run over the real tokens only
    (`packed`: their flat indices into B x T), which on a compute-bound CPU is most of a
    forward; only attention sees the padded [B, T] layout.
    """

    row0: int
    lens: Tensor  # [B] int64
    n_new: Tensor  # [B] int64
    positions: Tensor  # [B, T] rope positions
    write_rows: Tensor  # [B, T] cache slot of each token
    write_pos: Tensor  # [B, T] cache column of each token (the trash column for padding)
    kv_len: int  # attention reads columns [0, kv_len)
    mask: Tensor | None  # [B, 1, T, kv_len] bool, True = may attend; None = all visible
    packed: Tensor | None = None  # [N] flat indices of the real tokens; None = all real
    last: Tensor | None = None  # [B] index of each row's last real token in packed order
    width: int = 0  # T, the padded number of new tokens per row
    _grouped: dict[int, Tensor | None] = field(default_factory=dict, repr=False)

    @classmethod
    def make(
        cls,
        lens: Sequence[int],
        n_new: Sequence[int] | None,
        width: int,
        row0: int,
        trash: int,
        device: torch.device | str,
    ) -> Batch:
        b = len(lens)
        lens_t = torch.tensor(lens, dtype=torch.long, device=device)
        ar = torch.arange(width, device=device)
        positions = lens_t[:, None] + ar[None, :]
        if n_new is None:
            n_new_t = torch.full((b,), width, dtype=torch.long, device=device)
            kv_len = max(lens) + width
            write_pos = positions
        else:
            n_new_t = torch.tensor(n_new, dtype=torch.long, device=device)
            kv_len = max(n + m for n, m in zip(lens, n_new, strict=True))
            write_pos = torch.where(ar[None, :] < n_new_t[:, None], positions, trash)
            positions = positions.clamp(max=trash)
        write_rows = (torch.arange(b, device=device) + row0)[:, None].expand(b, width)
        if width == 1 and n_new is None and min(lens) == max(lens):
            mask = None  # one token per row, equal lengths: every cached column is visible
        else:
            # Causal within the new tokens and no look past a row's own valid length.
            cols = torch.arange(kv_len, device=device)
            mask = (cols[None, None, :] <= positions[:, :, None])[:, None]
        packed = last = None
        if n_new is not None and sum(n_new) < b * width and min(n_new) > 0:
            real = (ar[None, :] < n_new_t[:, None]).flatten()
            packed = real.nonzero()[:, 0]
            last = n_new_t.cumsum(0) - 1
            positions = positions.flatten()[packed][None]
            write_rows = write_rows.flatten()[packed][None]
            write_pos = write_pos.flatten()[packed][None]
        return cls(
            row0, lens_t, n_new_t, positions, write_rows, write_pos, kv_len, mask, packed, last,
            width,
        )  # fmt: skip

    def grouped_mask(self, groups: int, dtype: torch.dtype) -> Tensor | None:
        """`mask` with its T query rows repeated per query head of a group ([B, 1, g * T, L]),
        the layout of `grouped_attention`, as an additive mask of `dtype` (0 where a query may
        attend, -inf elsewhere): built once per forward and shared by all layers. Given the
        boolean mask, the CPU kernel converts it to this form in every layer's call (a third
        of a verify pass's attention time at batch 64)."""
        if groups not in self._grouped:
            m = self.mask
            if m is not None:
                m = m if groups == 1 else m.repeat(1, 1, groups, 1)
                m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(
                    ~m, float("-inf")
                )
            self._grouped[groups] = m
        return self._grouped[groups]

    def unpack(self, x: Tensor) -> Tensor:
        """Packed [1, N, ...] -> padded [B, T, ...] (zeros at padding)."""
        if self.packed is None:
            return x
        b = self.lens.shape[0]
        out = x.new_zeros((b * self.width,) + x.shape[2:])
        out[self.packed] = x[0]
        return out.view((b, self.width) + x.shape[2:])

    def pack(self, x: Tensor) -> Tensor:
        """Padded [B, T, ...] -> packed [1, N, ...]."""
        if self.packed is None:
            return x
        return x.flatten(0, 1)[self.packed][None]


class Rope:
    """Rotary embedding tables (HF rotate_half convention) for positions [0, max_pos]."""

    def __init__(self, head_dim: int, theta: float, max_pos: int, dtype: torch.dtype, device):
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_pos + 1, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)

    def tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.cos[positions][:, :, None, :], self.sin[positions][:, :, None, :]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def grouped_attention(q: Tensor, keys: Tensor, values: Tensor, batch: Batch, groups: int) -> Tensor:
    """Cached attention of q [B, T, nq, hd] over keys/values [B, nkv, L, hd] -> [B, nq, T, hd].

    Grouped-query attention as plain attention over the kv heads: the `groups` query heads
    that share a kv head become extra query rows of it ([B, nkv, groups * T, hd], head h =
    kv * groups + g, torch's repeat_interleave convention). The CPU kernel then reads each kv
    head once per block of query rows instead of once per query head: 10-30% less attention
    time at decode and verify shapes (benchmarks/RESULTS.md, "Grouped-query attention").
    """
    b, t, nq, hd = q.shape
    nkv = keys.shape[1]
    qg = q.transpose(1, 2).reshape(b, nkv, groups * t, hd)
    att = F.scaled_dot_product_attention(
        qg, keys, values, attn_mask=batch.grouped_mask(groups, q.dtype)
    )
    return att.reshape(b, nq, t, hd)  # not view: CUDA kernels may return another layout


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class DecoderLayer(nn.Module):
    """Pre-norm attention (GQA, RoPE, optional qkv bias) + SwiGLU MLP; fused qkv and gate_up.

    `input_norm=False` drops the attention input norm (identity, no weight): the layout of the
    EAGLE drafter's only layer, which is SGLang's / EAGLE's layer 0.
    """

    def __init__(self, cfg: ModelConfig, input_norm: bool = True) -> None:
        super().__init__()
        self.nq, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps) if input_norm else None
        self.qkv = nn.Linear(h, (self.nq + 2 * self.nkv) * self.hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.nq * self.hd, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(
        self,
        x: Tensor,
        batch: Batch | None,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor | None,
        v_cache: Tensor | None,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        """With a cache: write the new K/V and attend per `batch`.

        Without (training): causal over the T positions, or `attn_mask` [B, 1, T, T] (True =
        may attend; e.g. block-diagonal for packed sequences) when given.
        """
        # Functional calls on the modules' parameters: nn.Module.__call__ costs more than the
        # matmuls of a small model at batch 1.
        # A packed batch brings x as [1, N, H] (real tokens only) and rope tables to match.
        b, t, h = x.shape
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        xn = x if ln1 is None else F.rms_norm(x, (h,), ln1.weight, ln1.eps)
        qkv = F.linear(xn, self.qkv.weight, self.qkv.bias)
        qkv = qkv.view(b, t, self.nq + 2 * self.nkv, self.hd)
        # One rotation for q and k together (they sit side by side in the fused projection).
        qk = _rotate(qkv[:, :, : self.nq + self.nkv], cos, sin)
        q, k = qk.split([self.nq, self.nkv], dim=2)
        v = qkv[:, :, self.nq + self.nkv :]
        gqa = self.nq != self.nkv
        if batch is None or k_cache is None or v_cache is None:
            att = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=attn_mask,
                is_causal=attn_mask is None,
                enable_gqa=gqa,
            )
        else:
            k_cache[batch.write_rows, :, batch.write_pos] = k
            v_cache[batch.write_rows, :, batch.write_pos] = v
            rows_b = batch.lens.shape[0]
            rows = slice(batch.row0, batch.row0 + rows_b)
            keys = k_cache[rows, :, : batch.kv_len]
            values = v_cache[rows, :, : batch.kv_len]
            att = grouped_attention(batch.unpack(q), keys, values, batch, self.nq // self.nkv)
            att = batch.pack(att.transpose(1, 2)).transpose(1, 2)
        x = x + F.linear(att.transpose(1, 2).reshape(b, t, self.nq * self.hd), self.o_proj.weight)
        gate_up = F.linear(F.rms_norm(x, (h,), ln2.weight, ln2.eps), self.gate_up.weight)
        gate, up = gate_up.chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down_proj.weight)


class CausalLM(nn.Module):
    """The target model. `forward` runs new tokens of B cache rows and returns logits (+hidden)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._rope: Rope | None = None

    @property
    def lm_head_weight(self) -> Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: Tensor) -> Tensor:
        """lm_head over final-norm hidden states (also used by the EAGLE drafter)."""
        return F.linear(hidden, self.lm_head_weight)

    def rope(self, max_pos: int) -> Rope:
        p = next(self.parameters())
        if (
            self._rope is None
            or self._rope.cos.shape[0] <= max_pos
            or self._rope.cos.dtype != p.dtype
        ):
            self._rope = Rope(
                self.config.head_dim, self.config.rope_theta, max_pos, p.dtype, p.device
            )
        return self._rope

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        p = next(self.parameters())
        c = self.config
        return KVCache(c.num_layers, slots, max_len, c.num_kv_heads, c.head_dim, p.dtype, p.device)

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,
        cache: KVCache,
        batch: Batch,
        last_only: bool = False,
        return_hidden: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """tokens [B, T] -> logits [B, T, V] (or [B, V] at each row's last real token).

        The new tokens' K/V are written into the cache; the caller advances cache.lens.
        The hidden state returned is post final norm (what lm_head consumes), [B, T, H].
        """
        cos, sin = self.rope(cache.max_len).tables(batch.positions)
        x = batch.pack(self.embed_tokens(tokens))
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, batch, cos, sin, cache.k[i], cache.v[i])
        h = F.rms_norm(x, (x.shape[-1],), self.norm.weight, self.norm.eps)
        b = tokens.shape[0]
        if last_only:
            if batch.last is not None:
                h_last = h[0, batch.last]
            else:
                h_last = h[torch.arange(b, device=h.device), batch.n_new - 1]
            return self.logits(h_last), (batch.unpack(h) if return_hidden else None)
        return batch.unpack(self.logits(h)), (batch.unpack(h) if return_hidden else None)


def _fuse_state_dict(sd: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """HF parameter names -> ours (q/k/v fused into qkv, gate/up into gate_up)."""
    out: dict[str, Tensor] = {"embed_tokens.weight": sd["model.embed_tokens.weight"]}
    out["norm.weight"] = sd["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        o = f"layers.{i}."
        out[o + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        out[o + "post_attention_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
        out[o + "qkv.weight"] = torch.cat([sd[a + n + "_proj.weight"] for n in "qkv"])
        if cfg.qkv_bias:
            out[o + "qkv.bias"] = torch.cat([sd[a + n + "_proj.bias"] for n in "qkv"])
        out[o + "o_proj.weight"] = sd[a + "o_proj.weight"]
        m = p + "mlp."
        out[o + "gate_up.weight"] = torch.cat(
            [sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]]
        )
        out[o + "down_proj.weight"] = sd[m + "down_proj.weight"]
    return out


def load_weights(model: CausalLM, state_dict: Mapping[str, Tensor]) -> None:
    """Copy HF-named weights into the model in place (new policy weights between steps).

    All or nothing: every tensor is checked against the model before any is copied
    (`load_state_dict` copies the tensors that fit before it raises on one that does not,
    which would leave a model that is neither policy under the old version's name)."""
    cfg = model.config
    try:
        fused = _fuse_state_dict(state_dict, cfg)
    except KeyError as exc:
        raise ValueError(f"weights do not fit the model: {exc.args[0]} is missing") from None
    own = model.state_dict()
    problems = [f"missing {k}" for k in sorted(own.keys() - fused.keys())]
    problems += [f"unexpected {k}" for k in sorted(fused.keys() - own.keys())]
    problems += [
        f"{k} has shape {tuple(v.shape)}, the model {tuple(own[k].shape)}"
        for k, v in fused.items()
        if k in own and v.shape != own[k].shape
    ]
    deeper = sorted(
        {int(k.split(".")[2]) for k in state_dict if re.match(r"model\.layers\.\d+\.", k)}
        - set(range(cfg.num_layers))
    )
    if deeper:
        problems.append(f"layers {deeper} beyond the model's {cfg.num_layers}")
    if problems:
        raise ValueError("weights do not fit the model: " + "; ".join(problems[:5]))
    model.load_state_dict(fused, strict=True)


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """All tensors of a HF checkpoint directory (model.safetensors or sharded *.safetensors)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    sd: dict[str, Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd


def serving_dtype(path: str | Path, device: torch.device | str) -> torch.dtype:
    """The dtype a rollout engine runs a checkpoint in: on a GPU the half-precision dtype its
    config.json names (`dtype`, or `torch_dtype` before transformers 5), else float32. On a
    CPU always float32: half-precision matmuls are slower there, not faster."""
    if torch.device(device).type != "cuda":
        return torch.float32
    cfg = json.loads((Path(path) / "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(str(name), torch.float32)


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> CausalLM:
    """Build the model from a HF directory (config.json + safetensors, HF parameter names)."""
    cfg = ModelConfig.from_hf(json.loads((Path(path) / "config.json").read_text()))
    model = CausalLM(cfg)
    load_weights(model, read_state_dict(path))
    return model.to(dtype=dtype, device=device).eval()
