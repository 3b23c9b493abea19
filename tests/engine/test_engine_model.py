"""The plain-torch model matches transformers on the same checkpoint (prefill and decode)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import make_checkpoint
from tests.torch_device import torch_device
from tltd_workers.engine.transformer import Batch, load_model


@pytest.mark.parametrize(
    "arch,tie,head_dim",
    [("qwen2", True, None), ("qwen2", False, None), ("llama", True, None), ("llama", False, 24)],
)
def test_logits_match_transformers(tmp_path, arch, tie, head_dim):
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(tmp_path / "m", arch, tie=tie, head_dim=head_dim, seed=3)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    dev = torch_device()
    ours = load_model(path, device=dev)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 64, (n,), generator=g) for n in (7, 12, 3)]
    with torch.no_grad():
        want = [ref(s[None]).logits[0] for s in seqs]

    # Ragged prefill of all three rows at once (padding goes to the trash column).
    cache = ours.new_cache(slots=4, max_len=32)
    width = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    batch = Batch.make([0, 0, 0], [len(s) for s in seqs], width, 0, cache.trash, dev)
    logits, _ = ours(tokens.to(dev), cache, batch)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(logits[i, : len(s)].cpu(), want[i], atol=1e-4, rtol=1e-4)

    # Step-by-step decode of every row through the cache, one token per row per forward.
    cache = ours.new_cache(slots=4, max_len=32)
    for t in range(max(len(s) for s in seqs)):
        live = [i for i, s in enumerate(seqs) if t < len(s)]
        # keep only rows still decoding: here all rows stay in place, finished ones get a pad
        tok = torch.tensor([[int(s[min(t, len(s) - 1)])] for s in seqs], device=dev)
        batch = Batch.make(
            [min(t, len(s)) for s in seqs],
            [1 if i in live else 0 for i in range(3)],
            1,
            0,
            cache.trash,
            dev,
        )
        out, _ = ours(tok, cache, batch)
        for i in live:
            torch.testing.assert_close(out[i, 0].cpu(), want[i][t], atol=1e-4, rtol=1e-4)


def test_serving_dtype_is_the_configs_half_precision_on_gpus_only(tmp_path):
    import json

    from tltd_workers.engine.transformer import serving_dtype

    for name, want in (("bfloat16", torch.bfloat16), ("float16", torch.float16),
                       ("float32", torch.float32), (None, torch.float32)):  # fmt: skip
        for key in ("dtype", "torch_dtype"):  # transformers 5, and earlier checkpoints
            d = tmp_path / f"{key}-{name}"
            d.mkdir()
            (d / "config.json").write_text(json.dumps({key: name} if name else {}))
            assert serving_dtype(d, "cuda:0") == want
            assert serving_dtype(d, "cpu") == torch.float32
