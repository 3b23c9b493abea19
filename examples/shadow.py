"""The shadow measurement: on one RL step's own samples, the accepted length of the drafter the
daemon used and of the frozen initial drafter, measured the same way (docs/sd-statistics.md,
"shadow accepted length").

Both drafters run teacher-forced greedy k-chains from every response position of the samples,
against the target features of the policy that sampled them (the trainer's weights before the
step's update): `tltd_workers.drafter.versions.mean_accepted_length`, the measure the daemon's
promotion gate uses. One target prefill per sample serves both drafters.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from tltd_clients import RolloutSample
from tltd_workers.drafter.forward import target_hidden
from tltd_workers.drafter.versions import HeldOut, mean_accepted_length
from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.engine.transformer import CausalLM, ModelConfig, load_weights


class ShadowMeter:
    """The target (reloaded with each step's policy weights) and the drafters to compare."""

    def __init__(self, model_dir: Path, frozen: Path, k: int = 4, samples: int = 16) -> None:
        cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
        self.target = CausalLM(cfg).eval()
        self.frozen_path, self.k, self.samples = frozen, k, samples
        self._drafters: dict[str, EagleDrafter] = {}

    def _drafter(self, path: Path) -> EagleDrafter:
        # Bound to self.target, whose weights are replaced in place each step: a drafter
        # shares the target's embeddings and lm_head, as in the daemon.
        key = str(path)
        if key not in self._drafters:
            self._drafters[key] = EagleDrafter.from_pretrained(path, self.target)
        return self._drafters[key]

    def pick(self, samples: Sequence[RolloutSample]) -> list[RolloutSample]:
        """An even spread of the step's samples (every m-th in prompt, sample order)."""
        ordered = sorted(samples, key=lambda s: (s.prompt_index, s.sample_index))
        stride = max(1, len(ordered) // self.samples)
        return [s for s in ordered[::stride] if s.token_ids][: self.samples]

    def measure(
        self,
        policy: Mapping[str, Tensor],
        samples: Sequence[RolloutSample],
        prompts: Sequence[list[int]],
        used: Path | None,
    ) -> tuple[float, float]:
        """(accepted length of the drafter used, of the frozen initial drafter) on the samples,
        with chains of the meter's k drafts."""
        return self.measure_at(policy, samples, prompts, used, (self.k,))[0]

    @torch.inference_mode()
    def measure_at(
        self,
        policy: Mapping[str, Tensor],
        samples: Sequence[RolloutSample],
        prompts: Sequence[list[int]],
        used: Path | None,
        ks: Sequence[int],
    ) -> list[tuple[float, float]]:
        """`measure` with chains of each of `ks` drafts, on one prefill of the samples."""
        load_weights(self.target, policy)
        held = []
        for s in self.pick(samples):
            prompt = prompts[s.prompt_index]
            ids = torch.tensor(list(prompt) + list(s.token_ids), dtype=torch.long)
            hidden = target_hidden(self.target, [ids])[0]
            held.append(HeldOut(ids, len(prompt), hidden))
        out = []
        for k in ks:
            frozen = mean_accepted_length(self._drafter(self.frozen_path), held, k)
            if used is None or used == self.frozen_path:
                out.append((frozen, frozen))
            else:
                out.append((mean_accepted_length(self._drafter(used), held, k), frozen))
        return out
