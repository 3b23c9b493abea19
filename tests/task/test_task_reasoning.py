"""Tests for the count-up task: determinism, long-tailed lengths, re-checks, and the reward."""

from __future__ import annotations

import random
import re

import pytest

from examples.task.reasoning import (
    CHECK_MARKER,
    MAX_STEPS,
    MIN_STEPS,
    format_prompt,
    generate_problem,
    make_dataset,
    make_problem,
    parse_answer,
    reward,
    size_at_quantile,
)


def test_generation_is_deterministic_per_seed():
    assert make_dataset(50, seed=7) == make_dataset(50, seed=7)
    assert make_dataset(50, seed=7) != make_dataset(50, seed=8)


def test_problem_fields_are_consistent():
    p = make_problem(start=17, step=38, count=3, style="sum")
    assert format_prompt(p) == "start 0017 step 38 count 0003 care 7\n"
    lines = ["care 7", "0017+0038=0055,0002", "0055+0038=0093,0001", "0093+0038=0131,0000",
             "care 7", "answer:   0131"]  # fmt: skip
    assert p.solution == "\n".join(lines)
    assert p.answer == 131 and p.num_steps == 3 and (p.checks, p.guess) == (0, False)


def test_a_recheck_redoes_the_whole_computation_and_a_guess_skips_it():
    p = make_problem(17, 38, 2, checks=2, care=3, style="sum")
    work = ["0017+0038=0055,0001", "0055+0038=0093,0000"]
    done = [*work, "care 3"]  # every pass ends restating the care, right before the choice
    expected = ["care 3"] + done + [CHECK_MARKER] + done + [CHECK_MARKER] + done
    assert p.solution.split("\n")[:-1] == expected and p.solution.endswith("answer:   0093")
    assert p.prompt.endswith("care 3\n")
    assert reward(p, p.solution) == 1.0
    g = make_problem(17, 38, 2, checks=5, guess=True, style="sum")
    assert g.solution == "answer:   0093" and g.checks == 0
    # Re-checks are not capped: a big problem at high care outgrows the rollout cap.
    big = make_problem(1, 10, MAX_STEPS, checks=50)
    assert big.checks == 50 and len(big.solution) > 51 * MAX_STEPS * 20
    with pytest.raises(ValueError, match="care"):
        make_problem(17, 38, 2, care=10)
    with pytest.raises(ValueError, match="checks"):
        make_problem(17, 38, 2, checks=-1)


def test_rechecks_are_geometric_at_the_prompts_care_and_lengthen_the_tail():
    rng = random.Random(0)
    for care in (0, 5, 8):
        probs = [generate_problem(rng, num_steps=1, care=care, guess_rate=0) for _ in range(4000)]
        # P(checks >= 1) = care / 10 (a geometric law), within sampling noise.
        share = sum(p.checks >= 1 for p in probs) / len(probs)
        assert abs(share - care / 10) < 0.03
    guesses = [generate_problem(rng, care=7).guess for _ in range(4000)]
    assert abs(sum(guesses) / len(guesses) - 0.2) < 0.03

    def p99_over_median(care: int) -> float:
        lengths = sorted(len(p.solution) for p in make_dataset(4000, seed=1, care=care))
        return lengths[int(0.99 * len(lengths))] / lengths[len(lengths) // 2]

    # The same prompts' answers get much longer tails when the policy re-checks more.
    assert p99_over_median(8) > 12 > 9 > p99_over_median(0)


@pytest.mark.parametrize(
    ("start", "step", "count", "field"),
    [(-1, 20, 3, "start"), (5, 100, 3, "step"), (5, 20, 0, "count"), (0, 10, 25, "count")],
)
def test_make_problem_rejects_out_of_range_numbers(start, step, count, field):
    with pytest.raises(ValueError, match=field):
        make_problem(start, step, count)


def test_requested_step_count_is_exact_and_sizes_stay_in_range():
    for k in (MIN_STEPS, 2, 13, MAX_STEPS):
        assert all(p.num_steps == k for p in make_dataset(30, seed=k, num_steps=k))
    rng = random.Random(0)
    sizes = [generate_problem(rng).num_steps for _ in range(2000)]
    assert min(sizes) == MIN_STEPS and max(sizes) <= MAX_STEPS
    assert size_at_quantile(0.0) == MIN_STEPS and size_at_quantile(0.999999) == MAX_STEPS
    with pytest.raises(ValueError, match="num_steps"):
        generate_problem(rng, num_steps=MAX_STEPS + 1)


def test_reference_lengths_are_long_tailed():
    lengths = sorted(len(p.solution) for p in make_dataset(5000, seed=0))
    median = lengths[len(lengths) // 2]
    p99 = lengths[int(0.99 * len(lengths))]
    assert 80 <= median <= 200
    assert p99 / median > 8
    assert lengths[-1] > 15 * median
    assert lengths[-1] > 1800  # the tail reaches the thousands of tokens


def test_reward_is_one_for_the_reference_solution():
    for p in make_dataset(200, seed=3):
        assert reward(p, p.solution) == 1.0


def test_reward_is_zero_for_a_wrong_final_answer():
    p = make_problem(17, 38, 3, style="sum")
    assert reward(p, p.solution.replace("answer:   0131", "answer:   0130")) == 0.0
    assert reward(p, "answer: 93") == 0.0


def test_reward_is_zero_for_truncated_or_rambling_answers():
    p = make_problem(17, 38, 3)
    assert reward(p, p.solution[: p.solution.index("answer")]) == 0.0
    rambling = "\n".join(["0017+0038=0055,0002"] * 20)
    assert reward(p, rambling) == 0.0
    # The right number followed by more text, or given twice, is not a clean final answer.
    assert reward(p, p.solution + "\n0131+0038=0169,0000") == 0.0
    assert reward(p, p.solution + "\n" + p.solution) == 0.0


def test_parse_answer_tolerates_trailing_whitespace_only():
    assert parse_answer("0001+0010=0011,0000\nanswer: 11\n", "sum") == 11
    assert parse_answer("answer: 0011", "sum") == 11
    assert parse_answer("answer: 1100", "reversed") == 11
    assert parse_answer("answer: 11 x") is None
    assert parse_answer("") is None


def test_other_line_styles_keep_the_computation_and_the_reward():
    from examples.task.reasoning import LINE_STYLES
    from examples.task.tokenizer import UNK_ID, build_tokenizer

    p = make_problem(17, 38, 2, style="spaced")
    assert p.solution == (
        "care 7\n0017 + 0038 = 0055 > 0001\n0055 + 0038 = 0093 > 0000\ncare 7\nanswer:       0093"
    )
    marks = make_problem(17, 38, 2, style="marks").solution
    assert marks.startswith("care 7\n0017*0038>0055.0001\n")
    tok = build_tokenizer()
    for style in LINE_STYLES:
        q = generate_problem(random.Random(3), 4, style=style)
        assert q.answer == generate_problem(random.Random(3), 4).answer
        assert q.checks == generate_problem(random.Random(3), 4).checks
        assert reward(q, q.solution) == 1.0
        assert UNK_ID not in tok.encode(q.solution, add_special_tokens=False).ids
    with pytest.raises(ValueError, match="style"):
        make_problem(17, 38, 2, style="nope")


def test_reversed_style_writes_every_number_least_significant_digit_first():
    p = make_problem(17, 38, 3, style="reversed", checks=1)
    assert p.prompt == "start 7100 step 83 count 3000 care 7\n"
    assert p.solution == (
        "care 7\n7100+8300=5500,2000\n5500+8300=3900,1000\n3900+8300=1310,0000\ncare 7\n"
        "check\n7100+8300=5500,2000\n5500+8300=3900,1000\n3900+8300=1310,0000\ncare 7\n"
        "answer:   1310"
    )
    assert p.answer == 131 and parse_answer(p.solution, "reversed") == 131
    assert reward(p, p.solution) == 1.0
    # Read the other way round it is another number; a wrong digit gets no credit.
    assert parse_answer(p.solution, "sum") == 1310
    assert reward(p, p.solution[:-1] + "2") == 0.0
    guess = make_problem(17, 38, 3, style="reversed", guess=True)
    assert guess.solution == "answer:   1310" and reward(guess, guess.solution) == 1.0


def test_reversed_style_is_the_sum_style_with_each_number_reversed():
    line = re.compile(r"(\d{4})\+(\d{4})=(\d{4}),(\d{4})")
    rng = random.Random(5)
    for _ in range(200):
        seed = rng.randrange(10**6)
        rev = generate_problem(random.Random(seed), style="reversed", care=range(9))
        fwd = generate_problem(random.Random(seed), style="sum", care=range(9))
        same = ("start", "step", "count", "care", "answer", "checks", "guess")
        assert [getattr(rev, f) for f in same] == [getattr(fwd, f) for f in same]
        assert reward(rev, rev.solution) == 1.0
        r_prompt, f_prompt = rev.prompt.split(), fwd.prompt.split()
        assert r_prompt[0::2] == f_prompt[0::2]  # the words and the care digit
        assert [w[::-1] for w in r_prompt[1:6:2]] == f_prompt[1:6:2]  # start, step, count
        for r_line, f_line in zip(rev.solution.split("\n"), fwd.solution.split("\n"), strict=True):
            if r_line.startswith("answer:"):
                assert r_line.split()[1] == f_line.split()[1][::-1]
                continue
            found = line.fullmatch(r_line)
            if found is None:
                assert r_line == f_line  # the care and check lines are the same
                continue
            assert line.fullmatch(f_line).groups() == tuple(g[::-1] for g in found.groups())
            # Digit j of the sum (left to right) needs only digit j of both terms and the
            # carry out of digit j - 1, written just before it.
            total, step, new, _ = found.groups()
            carry, digits = 0, ""
            for a, b in zip(total, step, strict=True):
                carry, digit = divmod(int(a) + int(b) + carry, 10)
                digits += str(digit)
            assert (carry, digits) == (0, new)


def test_make_dataset_draws_the_same_problems_in_every_style():
    fwd = make_dataset(20, seed=3, care=range(9), style="sum")
    rev = make_dataset(20, seed=3, care=range(9), style="reversed")
    assert [(p.start, p.step, p.count, p.answer, p.guess) for p in fwd] == [
        (p.start, p.step, p.count, p.answer, p.guess) for p in rev
    ]
    assert any(p.solution != q.solution for p, q in zip(fwd, rev, strict=True))
