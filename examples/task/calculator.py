"""The task's calculator tool: a turn of the policy ends when it writes `=`, and the environment
writes the sum of the line's two operands, as the policy would have, in the task's digit order.

Every line of a worked answer is `total+step=new,left`: the policy calls the tool by writing
`=` after the operands, and the tool's output is the `new` field, so the next turn goes on from
text the policy was trained on (",left" and the next line). The tool adds what the line says,
right or wrong: a line whose operands were copied wrong gets the sum of the wrong operands.
A bare guess (`answer:` at once) calls no tool, so it gains nothing from it.
"""

from __future__ import annotations

import re

from examples.task.reasoning import DIGITS_REVERSED, TASK_STYLE

CALL = "="  # the character that ends a turn and calls the tool
# The line's operands right before the call, as the "sum" and "reversed" styles write them (the
# shipped policy's is "reversed"; the other styles end their sums with another character).
_OPERANDS = re.compile(r"(\d{4})\+(\d{4})=$")


def calculator(text: str, style: str = TASK_STYLE) -> str:
    """The tool's output after `text` (the answer so far, ending with the call): the sum of the
    last line's operands as a 4-digit field in `style`'s digit order, or "" when the line
    before the call is not `total+step` (the tool then adds nothing and the policy goes on)."""
    found = _OPERANDS.search(text)
    if found is None:
        return ""
    reverse = style in DIGITS_REVERSED

    def number(field: str) -> int:
        return int(field[::-1] if reverse else field)

    total = (number(found.group(1)) + number(found.group(2))) % 10_000
    field = f"{total:04d}"
    return field[::-1] if reverse else field
