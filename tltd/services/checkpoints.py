"""Checks on Hugging Face model directories the daemon is asked to load, before a worker tries."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

from tltd.errors import InvalidArgument
from tltd.services.validation import MAX_PATH, check_text


def check_model_dir(path: str, field: str, *, require_weights: bool = False) -> Path:
    """The resolved directory, or InvalidArgument naming `field` and saying what is missing."""
    if not path:
        raise InvalidArgument("must not be empty", field=field)
    check_text(path, field, MAX_PATH)
    p = Path(path).expanduser()
    if not p.is_dir():
        raise InvalidArgument(f"{path} is not a directory readable by the daemon", field=field)
    if not (p / "config.json").is_file():
        raise InvalidArgument(f"{path} has no config.json (not a Hugging Face model)", field=field)
    try:
        _read_config(p)  # the workers and the token checks read it later
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{path}/config.json is unreadable: {exc}", field=field) from exc
    if require_weights and not any(p.glob("*.safetensors")):
        raise InvalidArgument(f"{path} has no *.safetensors weights", field=field)
    return p.resolve()


def vocab_size(model_path: str) -> int | None:
    """The model's vocabulary size from config.json, or None when it cannot be told."""
    try:
        return _cached_vocab_size(model_path)
    except LookupError:
        return None


@functools.lru_cache(maxsize=64)
def _cached_vocab_size(model_path: str) -> int:
    """Cached: a job's model directory does not change under it (policy updates are new dirs).
    A failure raises LookupError, which lru_cache does not keep: one unreadable moment must
    not turn the token checks off for the daemon's lifetime."""
    try:
        config = _read_config(Path(model_path))
    except (OSError, ValueError) as exc:
        raise LookupError(f"{model_path}/config.json: {exc}") from exc
    # Multimodal configs nest the language model's config.
    text = config.get("text_config")
    for cfg in (config, text if isinstance(text, dict) else {}):
        value = cfg.get("vocab_size")
        if isinstance(value, int) and value > 0:
            return value
    raise LookupError(f"{model_path}/config.json has no vocab_size")


# config.json fields that fix a model's tensors: a policy update must keep them all.
_ARCHITECTURE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


def _read_config(model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    if not isinstance(config, dict):
        raise ValueError("config.json is not a JSON object")
    return config


def check_same_architecture(new_dir: Path, model_dir: Path, field: str) -> None:
    """InvalidArgument naming `field` when the checkpoint in `new_dir` is not the architecture
    of the job's model (`model_dir`): new weights replace the old tensor by tensor, so a
    resized vocabulary or another depth cannot be loaded into the running workers.

    A Llama/Qwen2 config is compared as the torch engine reads it (a `head_dim` written out
    by a newer `transformers` equals the one implied; a changed `rope_theta` is a change);
    another family by the raw fields both configs state."""
    try:
        new = _read_config(new_dir)
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{new_dir}/config.json is unreadable: {exc}", field=field) from exc
    try:
        old = _read_config(model_dir)
    except (OSError, ValueError):
        return  # the job's own model is gone or unreadable: the workers will say so
    from workers.engine.model import ModelConfig  # torch: only the API paths that need it

    try:
        pair = ModelConfig.from_hf(new), ModelConfig.from_hf(old)
    except (ValueError, KeyError, TypeError):
        pair = None
    if pair is not None:
        for f in dataclasses.fields(ModelConfig):
            a, b = getattr(pair[0], f.name), getattr(pair[1], f.name)
            if a != b:
                raise InvalidArgument(
                    f"{new_dir} has {f.name} {a!r}, the job's model {b!r}: a policy update "
                    "must keep the model's architecture",
                    field=field,
                )
        return
    for new_cfg, old_cfg in ((new, old), (new.get("text_config"), old.get("text_config"))):
        if not isinstance(new_cfg, dict) or not isinstance(old_cfg, dict):
            continue
        for name in _ARCHITECTURE_FIELDS:
            if name in new_cfg and name in old_cfg and new_cfg[name] != old_cfg[name]:
                raise InvalidArgument(
                    f"{new_dir} has {name} {new_cfg[name]!r}, the job's model "
                    f"{old_cfg[name]!r}: a policy update must keep the model's architecture",
                    field=field,
                )


# The target config fields that shape a drafter's own tensors (its layer is built from them).
_DRAFTER_SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "qkv_bias",
)


def _safetensors_names(path: Path) -> list[str]:
    """Tensor names from a safetensors header (8-byte little-endian length, then JSON), read
    without loading the tensors."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size <= 100_000_000:
            raise ValueError("not a safetensors file")
        header = json.loads(f.read(size))
    return [k for k in header if k != "__metadata__"]


def check_drafter_dir(path: str, field: str, model_dir: Path) -> Path:
    """The resolved directory of an EAGLE drafter checkpoint (`EagleDrafter.save_pretrained`
    layout) usable on the model in `model_dir`, or InvalidArgument naming `field`: missing
    files, not a drafter, built for another model shape, or a legacy (input-norm) checkpoint."""
    if not path:
        raise InvalidArgument("must not be empty", field=field)
    check_text(path, field, MAX_PATH)
    p = Path(path).expanduser()
    if not p.is_dir():
        raise InvalidArgument(f"{path} is not a directory readable by the daemon", field=field)
    for name in ("config.json", "model.safetensors"):
        if not (p / name).is_file():
            raise InvalidArgument(f"{path} has no {name} (not a drafter checkpoint)", field=field)
    try:
        cfg = json.loads((p / "config.json").read_text())
        target = cfg["target"]
        hidden = int(target["hidden_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidArgument(
            f"{path}/config.json is not an EAGLE drafter config (no target.hidden_size: {exc})",
            field=field,
        ) from exc
    try:
        names = _safetensors_names(p / "model.safetensors")
    except (OSError, ValueError) as exc:
        raise InvalidArgument(
            f"{path}/model.safetensors is unreadable: {exc}", field=field
        ) from exc
    # Imported here: these modules pull in torch, which the API layer otherwise does not need.
    from workers.engine.eagle import IncompatibleDrafterCheckpoint, check_drafter_tensors
    from workers.engine.model import ModelConfig

    try:
        check_drafter_tensors(names, path)
    except IncompatibleDrafterCheckpoint as exc:
        raise InvalidArgument(str(exc), field=field) from exc
    try:
        model = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidArgument(
            f"the job's model config cannot be read to check the drafter: {exc}", field=field
        ) from exc
    if hidden != model.hidden_size:
        raise InvalidArgument(
            f"{path} was built for hidden size {hidden}, the job's model has {model.hidden_size}",
            field=field,
        )
    for name in _DRAFTER_SHAPE_FIELDS[1:]:
        if name in target and target[name] != getattr(model, name):
            raise InvalidArgument(
                f"{path} was built for {name} {target[name]}, the job's model has "
                f"{getattr(model, name)}",
                field=field,
            )
    return p.resolve()
