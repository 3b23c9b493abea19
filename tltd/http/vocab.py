"""A job model's text side for the HTTP door: its tokenizer.json (string prompts, text out,
stop strings), its end-of-sequence ids (these servers stop there unless told not to) and its
beginning-of-sequence id."""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tltd.errors import InvalidArgument

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Vocab:
    tokenizer: Any  # tokenizers.Tokenizer, or None when the model directory has none
    eos_ids: tuple[int, ...]
    bos_id: int | None = None

    def encode(self, text: str, field: str, special: bool = True) -> tuple[int, ...]:
        """Token ids of `text` as the model's tokenizer makes them (its post-processor adds
        special tokens unless `special` is False); InvalidArgument naming `field` without a
        tokenizer."""
        tok = self._need(field)
        ids = tuple(tok.encode(text, add_special_tokens=special).ids)
        if not ids:
            raise InvalidArgument("encodes to no tokens", field=field)
        return ids

    def stop_token(self, text: str, field: str) -> int:
        """The one token a stop string stands for: the engine stops on token ids only."""
        tok = self._need(field)
        token_id = tok.token_to_id(text)
        if token_id is None:
            ids = tok.encode(text, add_special_tokens=False).ids
            if len(ids) != 1:
                raise InvalidArgument(
                    f"stop string {text!r} is {len(ids)} tokens; tltd stops on single tokens "
                    "only (a string that is one token of the vocabulary, or stop_token_ids)",
                    field=field,
                )
            token_id = ids[0]
        return int(token_id)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of `ids` ("" without a tokenizer: the ids are the exact answer)."""
        if self.tokenizer is None or not ids:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def piece(self, token_id: int) -> str | None:
        """One token's text, or None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _need(self, field: str):
        if self.tokenizer is None:
            raise InvalidArgument(
                "text needs the job's tokenizer, and its model directory has no "
                "tokenizer.json (or the tokenizers package is not installed): send token ids",
                field=field,
            )
        return self.tokenizer


@functools.lru_cache(maxsize=32)
def vocab_for(model_path: str) -> Vocab:
    """Read once per model directory (a job's directory does not change under it)."""
    path = Path(model_path)
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        try:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions
            # Text is optional on this door: token ids still work. Say why text does not.
            log.warning("cannot load %s/tokenizer.json: %s", model_path, exc)
    bos = _config_ids(path, "bos_token_id")
    return Vocab(tokenizer, _config_ids(path, "eos_token_id"), bos[0] if bos else None)


def _config_ids(path: Path, key: str) -> tuple[int, ...]:
    """`key` (eos_token_id, bos_token_id) of generation_config.json, else of config.json (an
    int or a list)."""
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((path / name).read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int) and value >= 0:
            return (value,)
        if isinstance(value, list) and all(isinstance(v, int) and v >= 0 for v in value):
            return tuple(value)
    return ()
