"""The long-tail rollout workload used by benchmarks and the demo: prompts for the tiny policy."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from examples.task.reasoning import (
    TASK_STYLE,
    Problem,
    format_prompt,
    generate_problem,
    size_at_quantile,
)
from examples.task.tokenizer import EOS_ID, encode_prompt, load_tokenizer

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-policy"
# The cap of reasoning RL's rollouts: a few percent of samples (those that re-check many times,
# or get lost) run into it, which is the tail speculative decoding has to handle.
MAX_NEW_TOKENS = 2048
STOP_TOKEN_ID = EOS_ID
# Re-check rates of the workload's prompts, alternating over them: half re-check at rate 0.4,
# half at 0.8. Prompts differ in how long the policy reasons about them, as reasoning RL's
# prompts do, on top of the per-sample tail: the median answer is short (~115 tokens) while
# the high-care prompts' long samples reach the cap (max / median ~18, ~4% capped).
WORKLOAD_CARE = (4, 8)


def rollout_prompts(
    num_prompts: int = 16,
    seed: int = 0,
    model_dir: str | Path = MODEL_DIR,
    care: int | Sequence[int] = WORKLOAD_CARE,
    num_steps: int | None = None,
) -> list[tuple[Problem, list[int]]]:
    """`num_prompts` problems with their prompt token ids (<bos> first), deterministic per seed.

    Problem sizes are the size distribution's quantiles (i + 0.5) / num_prompts rather than
    random draws, so every workload of 16+ prompts has the prompt-level tail (a few 11-20 step
    problems among mostly 1-3 step ones); the terms themselves are random per seed. `care`
    sets the per-sample tail: how often the policy re-checks its work (reasoning.py), one level
    for every prompt or levels that alternate over the prompts.
    `num_steps` gives every problem that size instead (no prompt-level tail).
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {num_prompts}")
    tok = load_tokenizer(model_dir)
    rng = random.Random(seed)
    sizes = [num_steps or size_at_quantile((i + 0.5) / num_prompts) for i in range(num_prompts)]
    rng.shuffle(sizes)
    levels = [care] if isinstance(care, int) else list(care)
    style = model_style(model_dir)
    problems = [
        generate_problem(rng, num_steps=k, style=style, care=levels[i % len(levels)])
        for i, k in enumerate(sizes)
    ]
    return [(p, encode_prompt(tok, format_prompt(p))) for p in problems]


def model_style(model_dir: str | Path = MODEL_DIR) -> str:
    """The task style (reasoning.LINE_STYLES) a policy was trained on, from the training summary
    `scripts/train_policy.py` writes beside it: its prompts are written in that style. A
    model without one (e.g. a trainer's checkpoint) is the task's."""
    summary = Path(model_dir) / "training_summary.json"
    if not summary.exists():
        return TASK_STYLE
    return json.loads(summary.read_text())["config"].get("style", "sum")
