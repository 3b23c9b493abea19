"""Checks on Hugging Face model directories the daemon is asked to load, before a worker tries."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

from tltd.contract.checkpoint import (
    IncompatibleDrafterCheckpoint,
    ModelConfig,
    check_drafter_tensors,
    hf_tensor_shapes,
)
from tltd.errors import InvalidArgument
from tltd.services.validation import MAX_PATH, ModelLimits, check_text


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


def model_limits(model_path: str) -> ModelLimits:
    """The limits of the model in `model_path` from its config.json (read once per directory);
    all None when it cannot be read."""
    try:
        return _cached_limits(model_path)
    except LookupError:
        return ModelLimits()


@functools.lru_cache(maxsize=64)
def _cached_limits(model_path: str) -> ModelLimits:
    """Cached: a job's model directory does not change under it (policy updates are new dirs
    of the same architecture, max_position_embeddings included). A failure raises LookupError,
    which lru_cache does not keep: one unreadable moment must not turn the checks off for the
    daemon's lifetime."""
    try:
        config = _read_config(Path(model_path))
    except (OSError, ValueError) as exc:
        raise LookupError(f"{model_path}/config.json: {exc}") from exc
    # Multimodal configs nest the language model's config.
    text = config.get("text_config")
    found: dict[str, int] = {}
    for cfg in (config, text if isinstance(text, dict) else {}):
        for name in ("vocab_size", "max_position_embeddings"):
            value = cfg.get(name)
            if name not in found and isinstance(value, int) and value > 0:
                found[name] = value
    return ModelLimits(found.get("vocab_size"), found.get("max_position_embeddings"))


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


def check_policy_checkpoint(new_dir: Path, model_dir: Path, field: str) -> None:
    """InvalidArgument naming `field` unless the checkpoint in `new_dir` can replace the weights
    of the job's model (`model_dir`) in its workers. Everything is checked that can be without
    loading the weights, so that no version is recorded which the workers then fail to load:

    - config.json has every field the engine reads, and states the job's architecture: new
      weights replace the old tensor by tensor, so a resized vocabulary or another depth
      cannot be loaded into the running workers;
    - every *.safetensors header is whole (the byte ranges it describes tile the file exactly:
      a truncated copy is refused) and names exactly the tensors the engine loads, each with
      the model's shape and a floating-point dtype.

    A Llama/Qwen2 config is compared as the torch engine reads it (a `head_dim` written out
    by a newer `transformers` equals the one implied; a changed `rope_theta` is a change);
    another family by the raw fields both configs state, and its headers for wholeness only.
    """
    try:
        new = _read_config(new_dir)
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{new_dir}/config.json is unreadable: {exc}", field=field) from exc
    headers = _read_headers(new_dir, field)
    try:
        old = _read_config(model_dir)
    except (OSError, ValueError):
        return  # the job's own model is gone or unreadable: the workers will say so
    try:
        old_cfg = ModelConfig.from_hf(old)
    except (ValueError, KeyError, TypeError, AssertionError):
        _check_raw_fields(new, old, new_dir, field)  # a family the torch engine does not run
        return
    try:
        new_cfg = ModelConfig.from_hf(new)
    except KeyError as exc:
        raise InvalidArgument(
            f"{new_dir}/config.json has no {exc.args[0]!r}, which the job's model needs "
            "(is this a checkpoint of the policy?)",
            field=field,
        ) from exc
    except (ValueError, TypeError, AssertionError) as exc:
        raise InvalidArgument(
            f"{new_dir}/config.json is not a config of the job's model: {exc}", field=field
        ) from exc
    for f in dataclasses.fields(ModelConfig):
        a, b = getattr(new_cfg, f.name), getattr(old_cfg, f.name)
        if a != b:
            raise InvalidArgument(
                f"{new_dir} has {f.name} {a!r}, the job's model {b!r}: a policy update "
                "must keep the model's architecture",
                field=field,
            )
    _check_tensors(headers, new_cfg, new_dir, field, "the job's model")


def check_model_weights(model_dir: Path, field: str) -> None:
    """InvalidArgument naming `field` unless the *.safetensors in `model_dir` are whole and,
    for a model the torch engine reads (Llama/Qwen2), are the tensors its own config.json
    describes: a job on weights its workers cannot load would only fail there."""
    headers = _read_headers(model_dir, field)
    if not headers:
        return
    try:
        cfg = ModelConfig.from_hf(_read_config(model_dir))
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return  # another family: its engine checks its own tensors
    _check_tensors(headers, cfg, model_dir, field, "its config.json")


def check_policy_tensors(tensors: dict[str, dict], model_dir: Path, what: str, field: str) -> None:
    """InvalidArgument naming `field` unless tensors announced before their bytes ({name:
    {"dtype", "shape"}}, called `what` in messages) are those the job's model (`model_dir`)
    loads, each with its shape and a floating-point dtype. A model family the torch engine does
    not run is left to `check_policy_checkpoint` once the file is whole."""
    try:
        cfg = ModelConfig.from_hf(_read_config(model_dir))
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return
    _check_tensors(tensors, cfg, what, field, "the job's model")


def _check_raw_fields(new: dict, old: dict, new_dir: Path, field: str) -> None:
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


def checkpoint_tensors(model_dir: Path, field: str) -> dict[str, dict]:
    """Every tensor of a checkpoint directory by name: {"dtype", "shape", ...}."""
    return _read_headers(model_dir, field)


def _read_headers(model_dir: Path, field: str) -> dict[str, dict]:
    """Every tensor of a checkpoint directory's *.safetensors files (as the engine reads them:
    all of them, merged) by name, each header checked whole."""
    tensors: dict[str, dict] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        try:
            header = read_safetensors_header(path)
        except (OSError, ValueError) as exc:
            raise InvalidArgument(
                f"{path} is not a whole safetensors file: {exc}", field=field
            ) from exc
        for name in header.keys() & tensors.keys():
            raise InvalidArgument(f"{path} repeats tensor {name} of another file", field=field)
        tensors |= header
    return tensors


def _check_tensors(
    tensors: dict[str, dict], cfg: ModelConfig, new_dir: Path | str, field: str, model: str
) -> None:
    """Names, shapes and dtypes of a checkpoint against what the engine loads for `cfg` (the
    config of `model`, for messages)."""
    shapes, optional = hf_tensor_shapes(cfg)
    problems = [f"{n} is missing" for n in sorted(shapes.keys() - tensors.keys() - optional)]
    for name, t in sorted(tensors.items()):
        if name not in shapes:
            problems.append(f"{name} is not a tensor of {model}")
        elif tuple(t["shape"]) != shapes[name]:
            problems.append(f"{name} has shape {tuple(t['shape'])}, the model {shapes[name]}")
        elif t["dtype"] not in _FLOAT_DTYPES:
            problems.append(f"{name} has dtype {t['dtype']}, not a floating-point type")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise InvalidArgument(
            f"{new_dir} does not fit {model}: {'; '.join(problems[:5])}{more}",
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


# Bytes per element of every safetensors dtype; the engine casts floating-point weights to
# its own dtype, while an integer or 8-bit float tensor would be cast to nonsense.
_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
_FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
_MAX_HEADER = 100_000_000  # the safetensors loader's own limit


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """The tensors of a safetensors file by name ({"dtype", "shape", "data_offsets"}), read
    without the data and checked as the safetensors loader checks them: a header length that
    fits the file, a JSON object, each tensor's byte range the size of its dtype and shape,
    the ranges tiling the data exactly, to the end of the file. ValueError says what is
    wrong."""
    size = path.stat().st_size
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or not 0 < n <= min(_MAX_HEADER, size - 8):
            raise ValueError(
                f"its header length does not fit its {size} bytes (truncated, or not safetensors)"
            )
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    spans = []
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, t in tensors.items():
        try:
            dtype, shape, (begin, end) = t["dtype"], t["shape"], t["data_offsets"]
            ok = dtype in _DTYPE_BYTES and all(
                isinstance(x, int) and x >= 0 for x in (*shape, begin, end)
            )
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"tensor {name!r} has a malformed header entry")
        if end - begin != math.prod(shape) * _DTYPE_BYTES[dtype]:
            raise ValueError(f"tensor {name!r}: bytes {begin}-{end} do not hold {dtype} {shape}")
        spans.append((begin, end, name))
    end_of_data = 0
    for begin, end, name in sorted(spans):
        if begin != end_of_data:
            raise ValueError(f"tensor {name!r}: its bytes overlap another's or leave a gap")
        end_of_data = end
    if 8 + n + end_of_data != size:
        raise ValueError(
            f"its header describes {8 + n + end_of_data} bytes, the file has {size} (truncated?)"
        )
    return tensors


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
        names = list(read_safetensors_header(p / "model.safetensors"))
    except (OSError, ValueError) as exc:
        raise InvalidArgument(
            f"{path}/model.safetensors is unreadable: {exc}", field=field
        ) from exc
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
