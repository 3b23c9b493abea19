"""The torch device that the engine, SD and drafter tests run on.

`pytest --device cuda` (scripts/gpu_check.sh on a lent GPU) runs them on a GPU; everywhere
else they run on the CPU. Tests read it through `torch_device()` when they build an engine,
a model or a trainer, so one suite checks both paths.
"""

from __future__ import annotations

_selected = "cpu"


def select(device: str) -> None:
    """Called once from `pytest_configure` with the `--device` option."""
    global _selected
    _selected = device


def torch_device() -> str:
    return _selected
