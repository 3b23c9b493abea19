"""EAGLE-style learned drafter: fc([hidden; embed(next)]) -> one decoder layer -> target lm_head.

The decoder layer has no input norm (identity in front of attention), as EAGLE's layer 0
(SafeAILab EAGLE `cnets.py`) and SGLang's `LlamaForCausalLMEagle` / `Qwen2ForCausalLMEagle`
run it, so a drafter exported for SGLang computes exactly what was trained here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from tltd.contract.checkpoint import check_drafter_tensors
from tltd_workers.engine.kv_cache import KVCache
from tltd_workers.engine.transformer import Batch, CausalLM, DecoderLayer, ModelConfig

# choose(logits [B, V], step i, confidence wanted) -> (draft tokens [B], confidence [B] in
# [0, 1]: the chance the drafter gives its draft, or None when not wanted; chains are cut
# where its running product falls too low)
Chooser = Callable[[Tensor, int, bool], tuple[Tensor, Tensor | None]]


class EagleDrafter(nn.Module):
    """Predicts the target's next final-norm hidden state from (hidden state, next token).

    Position t of the drafter consumes (h_t, x_{t+1}): the target's hidden state at t and the
    token that followed, and predicts h_{t+1}; the target's lm_head turns a prediction into a
    draft distribution. The target's embeddings and lm_head are used by reference (not
    submodules), so they are neither trained nor saved with the drafter.
    """

    def __init__(self, target: CausalLM) -> None:
        super().__init__()
        cfg = target.config
        self.config = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.layer = DecoderLayer(cfg, input_norm=False)  # EAGLE's layer 0: no input norm
        self._target = [target]  # a list hides it from nn.Module registration

    @property
    def target(self) -> CausalLM:
        return self._target[0]

    def attach(self, target: CausalLM) -> None:
        """Use another target's (e.g. reloaded) embeddings and lm_head."""
        if target.config.hidden_size != self.config.hidden_size:
            raise ValueError("target hidden size differs from the drafter's")
        self._target[0] = target

    # -- construction / persistence ---------------------------------------------------------

    @classmethod
    def random_init(cls, target: CausalLM, seed: int = 0) -> EagleDrafter:
        p = next(target.parameters())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            drafter = cls(target)
        return drafter.to(dtype=p.dtype, device=p.device).eval()

    def save_pretrained(self, path: str | Path) -> None:
        """config.json + model.safetensors holding the drafter's own (trainable) parameters."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(tensors, str(out / "model.safetensors"))
        cfg = {"architecture": "eagle1", "target": asdict(self.config)}
        (out / "config.json").write_text(json.dumps(cfg, indent=2))

    @classmethod
    def from_pretrained(cls, path: str | Path, target: CausalLM) -> EagleDrafter:
        cfg = json.loads((Path(path) / "config.json").read_text())
        if ModelConfig(**cfg["target"]).hidden_size != target.config.hidden_size:
            raise ValueError(f"drafter at {path} was built for another hidden size")
        tensors = load_file(str(Path(path) / "model.safetensors"))
        check_drafter_tensors(tensors, path)
        drafter = cls(target)
        drafter.load_state_dict(tensors)
        p = next(target.parameters())
        return drafter.to(dtype=p.dtype, device=p.device).eval()

    # -- training path (no cache) ---------------------------------------------------------------

    def forward(
        self,
        hidden: Tensor,
        next_tokens: Tensor,
        positions: Tensor | None = None,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        """hidden [B, T, H] (h_0..h_{T-1}), next_tokens [B, T] (x_1..x_T) -> predicted h_1..h_T.

        The drafter trainer's path (no KV cache): causal attention over the T positions, or
        packed sequences with `positions` [B, T] (restarting at 0 per sequence) and
        `attn_mask` [B, 1, T, T] (True = may attend).
        """
        x = self.fc(torch.cat([hidden, self.target.embed_tokens(next_tokens)], dim=-1))
        b, t = next_tokens.shape
        if positions is None:
            positions = torch.arange(t, device=hidden.device)[None].expand(b, t)
        cos, sin = self.target.rope(int(positions.max()) + 1).tables(positions)
        return self.layer(x, None, cos, sin, None, None, attn_mask)

    def logits(self, features: Tensor) -> Tensor:
        return self.target.logits(features)

    # -- inference path -------------------------------------------------------------------------

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        p = next(self.parameters())
        c = self.config
        return KVCache(1, slots, max_len, c.num_kv_heads, c.head_dim, p.dtype, p.device)

    def _step(self, feats: Tensor, tokens: Tensor, batch: Batch, cache: KVCache) -> Tensor:
        x = batch.pack(torch.cat([feats, self.target.embed_tokens(tokens)], dim=-1))
        cos, sin = self.target.rope(cache.max_len).tables(batch.positions)
        out = self.layer(self.fc(x), batch, cos, sin, cache.k[0], cache.v[0])
        return batch.unpack(out)

    @torch.inference_mode()
    def absorb(
        self,
        cache: KVCache,
        feats: Sequence[Tensor | None],
        tokens: Sequence[Sequence[int]],
        row0: int = 0,
    ) -> None:
        """Append unconsumed (h_t, x_{t+1}) pairs (as `propose` takes them) to the drafter
        cache rows [row0, row0 + B) without drafting: a new prompt's own pairs, or a catch-up
        on positions decoded without the drafter."""
        self._feed(cache, feats, tokens, row0)
        c = [len(t) for t in tokens]
        rows = slice(row0, row0 + len(c))
        cache.lens[rows] = [n + m for n, m in zip(cache.lens[rows], c, strict=True)]

    def _feed(
        self,
        cache: KVCache,
        feats: Sequence[Tensor | None],
        tokens: Sequence[Sequence[int]],
        row0: int = 0,
    ) -> tuple[Tensor, Batch]:
        """One drafter forward over rows' unconsumed pairs, written into `cache` rows
        [row0, row0 + B)."""
        b, dev = len(feats), cache.k.device
        c = [len(t) for t in tokens]
        width = max(max(c), 1)
        h = torch.zeros(b, width, self.config.hidden_size, dtype=cache.k.dtype, device=dev)
        x = torch.zeros(b, width, dtype=torch.long, device=dev)
        for i, (f, t) in enumerate(zip(feats, tokens, strict=True)):
            if c[i]:
                h[i, : c[i]] = f
                x[i, : c[i]] = torch.tensor(t, dtype=torch.long)
        batch = Batch.make(cache.lens[row0 : row0 + b], c, width, row0, cache.trash, dev)
        return self._step(h, x, batch, cache), batch

    @torch.inference_mode()
    def propose(
        self,
        cache: KVCache,
        feats: Sequence[Tensor | None],
        tokens: Sequence[Sequence[int]],
        k: int,
        choose: Chooser,
        min_confidence: float = 0.0,
    ) -> tuple[Tensor, list[int]]:
        """Draft k tokens for rows [0, B) of `cache` (the engine's compacted slots).

        feats[b] [c_b, H] / tokens[b] (c_b ints) are the (h_t, x_{t+1}) pairs of row b the
        drafter has not consumed yet (c_b = 0: the row has no drafter state; its drafts are
        garbage and the caller discards them). They are appended to the drafter cache for
        good; the k - 1 positions fed with the drafter's own predictions are rolled back.
        Returns drafts [B, k] and per row how many leading
        drafts to verify: those whose cumulative confidence (product over the chain of each
        step's confidence, an estimate of the chance that the chain survives, as in EAGLE-2)
        stays >=
        `min_confidence`, and at least one. Drafting stops early once no row is confident; the
        drafts past that are padding. Any choice of draft length keeps decoding lossless; a
        short draft only saves verification work that would likely be rejected.
        """
        # Long on purpose: one drafting loop over k steps; its tensors live across steps.
        b = len(feats)
        dev = cache.k.device
        c = [len(t) for t in tokens]
        lens = list(cache.lens[:b])
        out, batch = self._feed(cache, feats, tokens)
        last = out[torch.arange(b, device=dev), (batch.n_new - 1).clamp(min=0)]
        committed = [n + m for n, m in zip(lens, c, strict=True)]
        # Rows without drafter state (c_b = 0) feed nothing; when every row feeds one token,
        # no per-row counts, so rows of equal length attend without a mask.
        one = None if all(c) else [1 if m else 0 for m in c]
        drafts: list[Tensor] = []
        cut = min_confidence > 0  # without a floor every row verifies all k drafts
        cum = torch.ones(b, dtype=torch.float64, device=dev)
        lengths = torch.zeros(b, dtype=torch.long, device=dev)
        for i in range(k):
            tok, conf = choose(self.logits(last), i, cut)
            drafts.append(tok)
            if cut:
                assert conf is not None
                cum = cum * conf.double()
                confident = cum >= min_confidence
                lengths += confident
                if i + 1 < k and not bool(confident.any()):
                    pad = k - 1 - i  # nobody is confident: stop drafting
                    drafts.extend([tok] * pad)
                    break
            if i + 1 < k:
                pos = [n + i for n in committed]
                batch = Batch.make(pos, one, 1, 0, cache.trash, dev)
                last = self._step(last[:, None], tok[:, None], batch, cache)[:, 0]
        cache.lens[:b] = committed  # roll back the positions fed with predicted features
        verify = lengths.clamp(min=1).tolist() if cut else [k] * b
        return torch.stack(drafts, dim=1), verify
