"""Tests for the committed tiny policy checkpoint and the rollout workload built on it."""

from __future__ import annotations

import pytest
import torch

from examples.task.reasoning import make_problem
from examples.task.tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE, build_tokenizer, decode
from examples.task.workload import MAX_NEW_TOKENS, MODEL_DIR, STOP_TOKEN_ID, rollout_prompts


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True).eval()


def test_checkpoint_files_and_size():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        assert (MODEL_DIR / name).is_file(), name
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 25 * 1024 * 1024


def test_committed_tokenizer_is_the_task_tokenizer():
    from examples.task.tokenizer import load_tokenizer

    assert load_tokenizer(MODEL_DIR).to_str() == build_tokenizer().to_str()


def test_checkpoint_shape(model):
    cfg = model.config
    assert cfg.model_type == "qwen2"
    # Deep and narrow: a CPU decode step bound by per-layer overhead and KV reads.
    assert (cfg.num_hidden_layers, cfg.hidden_size) == (16, 128)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.vocab_size == VOCAB_SIZE and cfg.eos_token_id == EOS_ID
    # Positions cover a prompt plus the workload's 2,048-token cap.
    assert cfg.max_position_embeddings >= 64 + MAX_NEW_TOKENS
    n_params = sum(p.numel() for p in model.parameters())
    assert 2_500_000 < n_params < 4_000_000
    assert model.dtype == torch.float32


def test_greedy_completion_is_well_formed(model):
    tok = build_tokenizer()
    problem = make_problem(start=123, step=45, count=2)
    prompt = [BOS_ID] + tok.encode(problem.prompt, add_special_tokens=False).ids
    out = model.generate(
        input_ids=torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=48,
        do_sample=False,
        eos_token_id=EOS_ID,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    text = decode(tok, out)
    # Well-formed: the prompt's care restated, then step lines "a+b=c,left" (or a guessed
    # answer), in the task alphabet; correctness is not asserted.
    assert text and set(text) <= set("0123456789+=,\nanswer: check")
    lines = text.splitlines()
    if not lines[0].startswith("answer:"):
        assert lines[0] == f"care {problem.care}"
        assert "+" in lines[1] and "=" in lines[1]


def test_rollout_workload_is_deterministic_and_long_tailed():
    a = rollout_prompts(16, seed=3)
    assert a == rollout_prompts(16, seed=3)
    assert [p for p, _ in a] != [p for p, _ in rollout_prompts(16, seed=4)]
    assert all(ids[0] == BOS_ID and EOS_ID not in ids for _, ids in a)
    sizes = sorted(p.num_steps for p, _ in a)
    assert sizes[len(sizes) // 2] <= 3 and sizes[-1] >= 15
    assert MAX_NEW_TOKENS >= max(len(p.solution) + 1 for p, _ in a)
    assert STOP_TOKEN_ID == EOS_ID


def test_rollout_prompts_rejects_an_empty_workload():
    with pytest.raises(ValueError, match="num_prompts"):
        rollout_prompts(0)


def test_transformers_fast_tokenizer_matches_the_task_tokenizer():
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(MODEL_DIR, local_files_only=True)
    problem = make_problem(start=5, step=12, count=3)
    text = problem.prompt + problem.solution
    ids = build_tokenizer().encode(text, add_special_tokens=False).ids
    assert hf(text, add_special_tokens=False)["input_ids"] == ids
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (BOS_ID, EOS_ID, 0)


def test_the_task_style_is_the_shipped_policys():
    from examples.task.reasoning import TASK_STYLE
    from examples.task.workload import model_style

    # The workload writes prompts in the style the model learnt; every default follows it.
    assert model_style(MODEL_DIR) == TASK_STYLE
    problem, ids = rollout_prompts(1, seed=0)[0]
    assert problem.style == TASK_STYLE
