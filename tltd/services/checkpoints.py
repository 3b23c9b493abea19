"""Checks on Hugging Face model directories the daemon is asked to load, before a worker tries."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tltd.errors import InvalidArgument


def check_model_dir(path: str, field: str, *, require_weights: bool = False) -> Path:
    """The resolved directory, or InvalidArgument naming `field` and saying what is missing."""
    if not path:
        raise InvalidArgument("must not be empty", field=field)
    p = Path(path).expanduser()
    if not p.is_dir():
        raise InvalidArgument(f"{path} is not a directory readable by the daemon", field=field)
    if not (p / "config.json").is_file():
        raise InvalidArgument(f"{path} has no config.json (not a Hugging Face model)", field=field)
    if require_weights and not any(p.glob("*.safetensors")):
        raise InvalidArgument(f"{path} has no *.safetensors weights", field=field)
    return p.resolve()


@functools.lru_cache(maxsize=64)
def vocab_size(model_path: str) -> int | None:
    """The model's vocabulary size from config.json, or None when it cannot be told.

    Cached: a job's model directory does not change under it (policy updates are new dirs).
    """
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    # Multimodal configs nest the language model's config.
    for cfg in (config, config.get("text_config") or {}):
        value = cfg.get("vocab_size")
        if isinstance(value, int) and value > 0:
            return value
    return None
