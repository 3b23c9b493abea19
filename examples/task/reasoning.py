"""Synthetic step-by-step reasoning task: add a step to a start `count` times, with re-checks.

Answer lengths are long-tailed at two levels, as reasoning RL's are. Per prompt, the problem
size (step count) follows a power law. Per *sample*, the reference solutions re-check their
work a random number of times: after the last line, a solution restates the prompt's `care`
digit ("care 7", as it did on its first line), then writes "check" and redoes the whole
computation with probability care / 10, else it writes the answer. A policy trained on them
samples that choice itself at temperature 1, so one prompt gives 60 tokens on one sample and
1,500 on the next, and every tail token is the policy's own output; the `care` of the prompts
sets how heavy the tail is (benchmarks sweep it).

A share GUESS_RATE of the solutions write the answer at once without working it out; a small
policy cannot compute `start + step * count` in its head, so those guesses mostly fail, and RL
has a clear, cheap thing to unlearn.
"""

from __future__ import annotations

import bisect
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

# Problem size (number of steps) follows a truncated power law: most problems take 1-4 steps,
# a few take 20-24.  Every step is one fixed-width line, so a pass's length is proportional to
# the step count.
MIN_STEPS = 1
MAX_STEPS = 24
SIZE_EXPONENT = 1.25
# Per-sample tail: the number of re-checks is geometric, P(>= r) = (care / 10) ** r. Training
# data draws care from CARE_LEVELS; a problem built without one has DEFAULT_CARE (the rollout
# workload's levels are in workload.py).
CARE_LEVELS = tuple(range(9))
DEFAULT_CARE = 7
GUESS_RATE = 0.2
CHECK_MARKER = "check"
CARE_LINE = "care {care}"
# Re-checks are not capped: a large problem at high care has reference solutions longer than
# the rollout's max_new_tokens, so a policy that learnt them runs into the length cap on a few
# percent of samples, as reasoning RL's rollouts do (training truncates them to its positions).
MAX_START = 999
MIN_STEP, MAX_STEP = 10, 99

ANSWER_MARKER = "answer:"
# Answer line layouts. "sum" is the task as first written (big-endian); "spaced" is the
# same computation with other separators and a wider line (25 characters instead of 19, so
# every copy-from-the-line-above distance changes); "marks" keeps the widths and changes only
# the separators. They are shifted data mixes for benchmarks/bench_drift.py to fine-tune the
# policy towards. "reversed" is the task written little-endian: every number of the prompt and
# of the answer, the answer line's included, has its digits least-significant first (prompt
# "start 7100 step 83 count 3000", line "7100+8300=5500,2000" for 0017 + 0038 = 0055 with 2
# steps left, "answer:   1310" for 131). A sum written most-significant digit first needs, at
# each digit, the carry out of digits not yet written; in this order each digit needs only the
# two digits above it and the carry from the digit just written, and every number is copied as
# it stands, never turned round. The answer line keeps its marker; its number sits under the
# last line's new total in every style. `reward` reads the answer in the problem's style.
LINE_STYLES = {
    "sum": "{total:04d}+{step:04d}={new:04d},{left:04d}",
    "spaced": "{total:04d} + {step:04d} = {new:04d} > {left:04d}",
    "marks": "{total:04d}*{step:04d}>{new:04d}.{left:04d}",
    "reversed": "{total:04d}+{step:04d}={new:04d},{left:04d}",
    "reversed-spaced": "{total:04d} + {step:04d} = {new:04d} > {left:04d}",
    "reversed-marks": "{total:04d}*{step:04d}>{new:04d}.{left:04d}",
}
# Styles whose numbers, in the prompt and in the answer, are written least-significant first
# ("reversed-spaced" and "reversed-marks" are "spaced" and "marks" in that order: the shifted
# mixes of a little-endian policy).
DIGITS_REVERSED = frozenset({"reversed", "reversed-spaced", "reversed-marks"})
# The style of the task as models/tiny-policy learnt it: the prompts the workload and the
# demo's dataset build, and the default of everything here.
TASK_STYLE = "reversed"
_ANSWER_LINES = {
    "sum": ANSWER_MARKER + "   {total:04d}",
    "spaced": ANSWER_MARKER + "       {total:04d}",
    "marks": ANSWER_MARKER + "   {total:04d}",
    "reversed": ANSWER_MARKER + "   {total:04d}",
    "reversed-spaced": ANSWER_MARKER + "       {total:04d}",
    "reversed-marks": ANSWER_MARKER + "   {total:04d}",
}
_ANSWER_RE = re.compile(r"answer:\s*(-?\d+)")


@dataclass(frozen=True)
class Problem:
    """Add `step` to `start`, `count` times; the answer is the final total.

    `care` (0-9) sets the rate of re-checks, care / 10; `solution` is one reference answer:
    `checks` re-checks, or a bare guess when `guess`.
    """

    start: int
    step: int
    count: int
    prompt: str
    solution: str
    answer: int
    care: int = 0
    checks: int = 0
    guess: bool = False
    style: str = TASK_STYLE  # LINE_STYLES: the layout, and the digit order of every number

    @property
    def num_steps(self) -> int:
        return self.count


def _size_cdf(exponent: float) -> list[float]:
    weights = [k**-exponent for k in range(MIN_STEPS, MAX_STEPS + 1)]
    total, acc, cdf = sum(weights), 0.0, []
    for w in weights:
        acc += w / total
        cdf.append(acc)
    cdf[-1] = 1.0
    return cdf


def size_at_quantile(q: float, exponent: float = SIZE_EXPONENT) -> int:
    """Inverse CDF of the problem-size (step count) distribution, q in [0, 1)."""
    return MIN_STEPS + bisect.bisect_left(_size_cdf(exponent), q)


def sample_num_steps(rng: random.Random, exponent: float = SIZE_EXPONENT) -> int:
    """Draw a step count from the long-tailed size distribution."""
    return size_at_quantile(rng.random(), exponent)


def format_prompt(problem: Problem) -> str:
    """The prompt text the policy conditions on (the tokenizer adds <bos> in front)."""
    return problem.prompt


def _pass_lines(start: int, step: int, count: int, style: str) -> tuple[list[str], int]:
    # One fixed-width line per step, "total+step=new,left" where `left` counts down the steps
    # still to do; the line with left 0000 is the last.  Fixed widths put everything a line
    # needs at a constant distance in the line above, and digit j of the sum under digit j of
    # both operands (the step is padded to 4 digits too), which is what lets a small model
    # learn it in minutes; the repetition is what lets n-gram and EAGLE drafters accept long
    # drafts.
    # In a DIGITS_REVERSED style the fields are the numbers with their 4 digits reversed (0130
    # -> 310, printed 0310).
    field = _number_field(style)
    lines, total = [], start
    for left in range(count - 1, -1, -1):
        new = total + step
        values = {"total": total, "step": step, "new": new, "left": left}
        lines.append(LINE_STYLES[style].format(**{k: field(v) for k, v in values.items()}))
        total = new
    return lines, total


def _reverse_digits(n: int, width: int = 4) -> int:
    """`n`'s `width` zero-padded digits in reverse order, as a number (0017 -> 7100)."""
    return int(f"{n:0{width}d}"[::-1])


def _number_field(style: str):
    """How `style` writes a 4-digit number: as it is, or with its digits reversed."""
    return _reverse_digits if style in DIGITS_REVERSED else int


def _solution_text(
    start: int,
    step: int,
    count: int,
    style: str = TASK_STYLE,
    checks: int = 0,
    guess: bool = False,
    care: int = DEFAULT_CARE,
) -> tuple[str, int]:
    one_pass, total = _pass_lines(start, step, count, style)
    lines = []
    if not guess:
        # The solution restates the prompt's care ("care 7") first, copied from right above,
        # and again after every pass, copied from one pass above; each restatement sits right
        # before the re-check-or-answer choice it sets. Without these lines a small policy
        # re-checked at the same rate whatever the care: it never looked the digit up in the
        # prompt hundreds of tokens back (and it copies even the first line only once that
        # digit's loss is weighted: scripts/train_policy.py --care-weight).
        reminder = CARE_LINE.format(care=care)
        lines.extend([reminder, *one_pass, reminder])
        for _ in range(checks):
            # A re-check redoes the computation from the prompt, line for line the same: the
            # span a drafter can copy, as a reasoning model's re-verification repeats itself.
            lines.extend([CHECK_MARKER, *one_pass, reminder])
    # Zero-padded and right under the last total's column, so writing it is the same
    # copy-from-the-line-above as every other field.
    lines.append(_ANSWER_LINES[style].format(total=_number_field(style)(total)))
    return "\n".join(lines), total


def sample_checks(rng: random.Random, care: int) -> int:
    """A geometric number of re-checks: each further one with probability care / 10."""
    checks = 0
    while rng.random() < care / 10:
        checks += 1
    return checks


def make_problem(
    start: int,
    step: int,
    count: int,
    style: str = TASK_STYLE,
    checks: int = 0,
    guess: bool = False,
    care: int = DEFAULT_CARE,
) -> Problem:
    """Build the problem (prompt, reference solution, answer) for explicit numbers; `style`
    picks the answer's line layout (LINE_STYLES); `checks` re-checks,
    or a bare guess; `care` is the prompt's re-check rate in tenths."""
    if style not in LINE_STYLES:
        raise ValueError(f"style: must be one of {sorted(LINE_STYLES)}, got {style!r}")
    if not 0 <= start <= MAX_START:
        raise ValueError(f"start: must be in [0, {MAX_START}], got {start}")
    if not MIN_STEP <= step <= MAX_STEP:
        raise ValueError(f"step: must be in [{MIN_STEP}, {MAX_STEP}], got {step}")
    if not MIN_STEPS <= count <= MAX_STEPS:
        raise ValueError(f"count: must be in [{MIN_STEPS}, {MAX_STEPS}], got {count}")
    if checks < 0:
        raise ValueError(f"checks: must be >= 0, got {checks}")
    if not 0 <= care <= 9:
        raise ValueError(f"care: must be in [0, 9], got {care}")
    checks = 0 if guess else checks
    if style in DIGITS_REVERSED:
        numbers = (_reverse_digits(start), _reverse_digits(step, 2), _reverse_digits(count))
    else:
        numbers = (start, step, count)
    prompt = "start {:04d} step {:02d} count {:04d} care {care}\n".format(*numbers, care=care)
    solution, answer = _solution_text(start, step, count, style, checks, guess, care)
    return Problem(start, step, count, prompt, solution, answer, care, checks, guess, style)


def generate_problem(
    rng: random.Random,
    num_steps: int | None = None,
    style: str = TASK_STYLE,
    care: int | Sequence[int] = DEFAULT_CARE,
    guess_rate: float = GUESS_RATE,
) -> Problem:
    """Draw one problem and one reference solution for it; `num_steps` defaults to a draw
    from the long-tailed size distribution; `care` is fixed or drawn from the levels given;
    re-checks and guesses follow their rates."""
    k = sample_num_steps(rng) if num_steps is None else num_steps
    if not MIN_STEPS <= k <= MAX_STEPS:
        raise ValueError(f"num_steps: must be in [{MIN_STEPS}, {MAX_STEPS}], got {k}")
    start = rng.randint(0, MAX_START)
    step = rng.randint(MIN_STEP, MAX_STEP)
    level = care if isinstance(care, int) else rng.choice(list(care))
    guess = rng.random() < guess_rate
    checks = sample_checks(rng, level)
    return make_problem(start, step, k, style, checks, guess, level)


def make_dataset(
    n: int,
    seed: int,
    num_steps: int | None = None,
    care: int | Sequence[int] = DEFAULT_CARE,
    style: str = TASK_STYLE,
) -> list[Problem]:
    """`n` problems, deterministic for a given seed (the same problems in every style)."""
    rng = random.Random(seed)
    return [generate_problem(rng, num_steps, style, care) for _ in range(n)]


def parse_answer(completion_text: str, style: str = TASK_STYLE) -> int | None:
    """The final answer of a completion written in `style`, or None when it has none or does
    not end with it.

    A completion is only judged when it ends with exactly one answer line: a rambling or
    truncated answer (no marker, text after it, or several answers) gets no credit.
    """
    if len(_ANSWER_RE.findall(completion_text)) != 1:
        return None
    last = completion_text.rstrip().rsplit("\n", 1)[-1].strip()
    found = _ANSWER_RE.fullmatch(last)
    if not found:
        return None
    digits = found.group(1)
    return int(digits[::-1] if style in DIGITS_REVERSED else digits)


def reward(problem: Problem, completion_text: str) -> float:
    """1.0 when the completion's final answer equals the problem's answer, else 0.0."""
    return 1.0 if parse_answer(completion_text, problem.style) == problem.answer else 0.0
