"""The project's synthetic reasoning task: problems, reward, tokenizer and rollout workload."""

from __future__ import annotations

from examples.task.reasoning import (
    Problem,
    format_prompt,
    generate_problem,
    make_dataset,
    make_problem,
    parse_answer,
    reward,
)
from examples.task.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    build_tokenizer,
    decode,
    encode_answer,
    encode_prompt,
    load_tokenizer,
)

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "VOCAB_SIZE",
    "Problem",
    "build_tokenizer",
    "decode",
    "encode_answer",
    "encode_prompt",
    "format_prompt",
    "generate_problem",
    "load_tokenizer",
    "make_dataset",
    "make_problem",
    "parse_answer",
    "reward",
]
