"""Tests for the character-level task tokenizer."""

from __future__ import annotations

from examples.task.reasoning import format_prompt, make_dataset
from examples.task.tokenizer import (
    BOS,
    BOS_ID,
    EOS,
    EOS_ID,
    PAD,
    PAD_ID,
    VOCAB_SIZE,
    build_tokenizer,
    decode,
    encode_answer,
    encode_prompt,
    load_tokenizer,
    save_tokenizer,
)


def test_special_tokens_have_fixed_ids():
    tok = build_tokenizer()
    assert (tok.token_to_id(PAD), tok.token_to_id(BOS), tok.token_to_id(EOS)) == (
        PAD_ID,
        BOS_ID,
        EOS_ID,
    )
    assert 40 <= VOCAB_SIZE <= 80 and tok.get_vocab_size() == VOCAB_SIZE


def test_round_trip_of_task_text_is_exact_and_one_token_per_character():
    tok = build_tokenizer()
    for p in make_dataset(50, seed=1):
        text = format_prompt(p) + p.solution
        ids = tok.encode(text, add_special_tokens=False).ids
        assert len(ids) == len(text)
        assert tok.decode(ids) == text


def test_prompt_starts_with_bos_and_answer_ends_with_eos():
    tok = build_tokenizer()
    p = make_dataset(1, seed=2)[0]
    prompt = encode_prompt(tok, format_prompt(p))
    answer = encode_answer(tok, p.solution)
    assert prompt[0] == BOS_ID and BOS_ID not in prompt[1:]
    assert answer[-1] == EOS_ID and EOS_ID not in answer[:-1]
    # decode drops specials and stops at the first <eos>.
    assert decode(tok, answer + [tok.token_to_id("7")]) == p.solution


def test_saved_tokenizer_loads_identically(tmp_path):
    save_tokenizer(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.to_str() == build_tokenizer().to_str()
    assert load_tokenizer(tmp_path / "tokenizer.json").get_vocab() == loaded.get_vocab()
