"""One owner per concept: the live requests' work queue changes only in
`tltd/supervisor/live_requests.py`; the supervisor, the drain, the leases and the scheduler's
snapshot only read it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWNER = ROOT / "tltd/supervisor/live_requests.py"
# WorkQueue's methods that change it (tltd/supervisor/work_queue.py).
MUTATORS = {"add", "drop_unit", "remove", "take", "finish", "lose_worker", "requeue", "close"}


def _queue_changes(tree: ast.AST) -> list[int]:
    """Lines that call a mutator on something named `queue` (`queue.take(...)`,
    `self.queue.finish(...)`)."""
    lines = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        target = node.func.value
        named = (isinstance(target, ast.Name) and target.id == "queue") or (
            isinstance(target, ast.Attribute) and target.attr == "queue"
        )
        if named and node.func.attr in MUTATORS:
            lines.append(node.lineno)
    return lines


def test_only_live_requests_changes_the_work_queue():
    found = {}
    for path in sorted((ROOT / "tltd").rglob("*.py")):
        if path != OWNER:
            lines = _queue_changes(ast.parse(path.read_text()))
            if lines:
                found[str(path.relative_to(ROOT))] = lines
    assert found == {}


def test_the_check_sees_a_change():
    """The walk finds the owner's own changes (it is not blind)."""
    assert len(_queue_changes(ast.parse(OWNER.read_text()))) >= 6
