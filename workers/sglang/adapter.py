"""SGLang adapter logic: engine arguments, request and response translation, the engine port.

Pure functions and a `Protocol`; nothing here imports sglang. `workers.sglang.real_engine` holds
the one class that talks to a real `sglang.Engine` (python/sglang/srt/entrypoints/engine.py);
`workers.rollout.sglang_worker` drives any object with the `SglangEngine` methods, which is how
the tests run the adapter against a fake engine.

What maps to what (SGLang names):
- `LoadModel` -> `sglang.Engine(**engine_args(...))`: token ids in and out
  (`skip_tokenizer_init`), one GPU (`base_gpu_id`), `random_seed`, `max_running_requests`,
  `context_length`, `mem_fraction_static`; speculation from `EngineSpec` and the drafter
  (`speculative_args`).
- one sample of an `AddWork` -> one `async_generate(input_ids=..., sampling_params=...,
  return_logprob=True, rid=...)` with `n=1` and its own `sampling_seed`;
- its output dict (`output_ids`, `meta_info.output_token_logprobs`, `meta_info.finish_reason`,
  `meta_info.spec_verify_ct`, ...) -> `Segment` (`read_output`) -> `tltd.domain.Sample`;
- `Cancel` / drain -> `tokenizer_manager.abort_request(rid=...)`;
- `LoadPolicy` -> `WeightUpdate(selector="target")` -> `update_weights_from_disk(model_path)`;
- `SetDrafter` -> `WeightUpdate(selector="draft")`: stock SGLang has no draft-weight update
  (only the TLT fork's `update_weights_from_tensor(..., is_draft_model=True)`), so an engine
  that cannot apply it in place answers False and the worker restarts it with a new
  `speculative_draft_model_path` (see `workers.rollout.sglang_worker`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from tltd.domain import FinishReason, SamplingParams
from workers.rollout.protocol import EngineSpec

Selector = Literal["target", "draft"]

# SGLang sizes its KV cache to this share of GPU memory at start. Not its default (~0.8-0.9):
# the drafter trainer runs on this same device when rollout goes idle, and needs room.
MEM_FRACTION_STATIC = 0.7

# Seeds stay below 2**31 - 1 so that they fit any int32 path SGLang's sampler may take.
_SEED_MODULUS = 2**31 - 1


@dataclass(frozen=True)
class WeightUpdate:
    """New weights from a checkpoint directory, for the target (policy) or the draft model."""

    path: str
    selector: Selector


class SglangEngine(Protocol):
    """The engine port: what the worker needs of an SGLang engine, one method per SGLang call
    (`workers.sglang.real_engine.SglangEngineAdapter` is the real one)."""

    def submit(self, rid: str, input_ids: Sequence[int], sampling_params: dict[str, Any]) -> None:
        """Start one generation (`async_generate(..., return_logprob=True, rid=rid)`)."""
        ...

    def poll(self, timeout: float) -> list[tuple[str, dict[str, Any]]]:
        """(rid, output dict) of the generations that ended within `timeout` seconds."""
        ...

    def abort(self, rid: str) -> None:
        """Stop a generation (`tokenizer_manager.abort_request(rid=rid)`): it ends soon with
        finish_reason "abort" and the tokens it had."""
        ...

    def update_weights(self, update: WeightUpdate) -> bool:
        """Load new weights in place: True when applied, False when this engine cannot update
        `update.selector` in place (the caller restarts it); raises when loading failed."""
        ...

    def shutdown(self) -> None:
        """Stop the engine and its processes (`Engine.shutdown`)."""
        ...


# Builds an engine from `engine_args`; the real one starts sglang.Engine(**args).
EngineFactory = Callable[[dict[str, Any]], SglangEngine]


# ---- LoadModel -> engine arguments ----------------------------------------------------------


def gpu_index(device: str) -> int:
    """The GPU of a device id ("cuda:3" -> 3, "cuda" -> 0); SGLang runs on CUDA only."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        raise ValueError(f"the sglang backend runs on CUDA devices only, got device {device!r}")
    return int(index or 0)


def speculative_args(spec: EngineSpec, drafter_path: str = "") -> dict[str, Any]:
    """SGLang's speculative arguments for a job's speculative config and its drafter.

    - spec_mode "off" -> none.
    - a learned drafter (an SGLang EAGLE checkpoint at `drafter_path`) with drafter "eagle" or
      "auto" -> EAGLE as one chain (topk 1) of the longest draft length, verifying steps + 1
      tokens. Stock SGLang speculates at every batch size: it has no batch-size switch nor a
      strategy bandit (TLT's fork adds those), so "adaptive" runs as "fixed" here.
    - no learned drafter yet: "auto" and "ngram" -> SGLang's model-free NGRAM drafter (as our
      n-gram drafter, it is free from step 0); "eagle" -> none until a drafter arrives.
    """
    if spec.spec_mode == "off":
        return {}
    steps = max(spec.draft_lengths) if spec.draft_lengths else 4
    if drafter_path and spec.drafter in ("eagle", "auto"):
        return {
            "speculative_algorithm": "EAGLE",
            "speculative_draft_model_path": drafter_path,
            "speculative_num_steps": steps,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": steps + 1,
        }
    if spec.drafter in ("ngram", "auto"):
        return {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": steps + 1}
    return {}


def engine_args(spec: EngineSpec, model_path: str, drafter_path: str = "") -> dict[str, Any]:
    """`sglang.Engine(**kwargs)` for a job's model (and drafter) on `spec.device`."""
    return {
        "model_path": model_path,
        "skip_tokenizer_init": True,  # token ids in, token ids out: no tokenizer needed
        "base_gpu_id": gpu_index(spec.device),
        "tp_size": 1,  # one worker per device
        "random_seed": spec.seed,
        "max_running_requests": spec.max_batch,  # the scheduler's capacity for this worker
        "context_length": spec.max_seq_len,
        "mem_fraction_static": MEM_FRACTION_STATIC,
        "log_level": "error",
    } | speculative_args(spec, drafter_path)


# ---- AddWork -> engine requests --------------------------------------------------------------


def sample_seed(seed: int, prompt_index: int, sample_index: int, segment: int = 0) -> int:
    """The `sampling_seed` of one sample (of one engine segment of it, after a restart): a
    function of these integers only, so a sample's randomness does not depend on which worker
    or batch runs it."""
    key = f"{seed}:{prompt_index}:{sample_index}:{segment}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "big") % _SEED_MODULUS


def sampling_params(
    sampling: SamplingParams, *, max_new_tokens: int, seed: int | None
) -> dict[str, Any]:
    """SGLang's `sampling_params` dict for one sample (n=1: every sample is its own request,
    with its own seed, abort and result; SGLang's radix cache shares the prompt's prefill
    between the sibling requests, so this costs no extra prefill)."""
    params: dict[str, Any] = {
        "n": 1,
        "temperature": sampling.temperature,  # SGLang: 0 -> greedy (top_k 1)
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,  # SGLang: -1 = whole vocab
        "max_new_tokens": max_new_tokens,
        # Stop only where the caller says, as the torch engine does: the trainer owns the
        # stop set, so the model's own EOS must not end a sample on one backend only.
        "ignore_eos": True,
    }
    if sampling.stop_token_ids:
        params["stop_token_ids"] = sorted(set(sampling.stop_token_ids))
    if seed is not None:
        params["sampling_seed"] = seed
    return params


# ---- engine output -> our terms -------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """What one engine generation produced."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish: str  # "stop" | "length" | "abort"
    message: str = ""  # SGLang's reason for an abort
    spec_steps: int = 0  # verify passes (each gains accepted drafts + 1 tokens)
    accepted: int = 0  # draft tokens accepted over them
    plain_steps: int = 0  # tokens not gained by a verify pass (the one from prefill)


def read_output(out: Mapping[str, Any]) -> Segment:
    """An `async_generate` output dict -> Segment.

    `output_token_logprobs` is [(logprob, token_id, text|None), ...], one per output id; its
    ids must be the output ids (else the logprobs would belong to other tokens). Speculative
    counters: `spec_verify_ct` verify passes; accepted drafts from `spec_num_correct_drafts`
    (older releases: `spec_accepted_drafts`, `spec_accept_token_num`), else derived: each pass
    gains accepted + 1 tokens and the first token comes from prefill.
    """
    meta = out.get("meta_info") or {}
    tokens = tuple(int(t) for t in out.get("output_ids") or ())
    triples = meta.get("output_token_logprobs") or ()
    logprobs = tuple(float(t[0]) for t in triples)
    if tuple(int(t[1]) for t in triples) != tokens:
        raise ValueError(
            f"engine returned {len(triples)} logprobs for {len(tokens)} tokens "
            "(output_token_logprobs do not match output_ids)"
        )
    reason = meta.get("finish_reason")
    if isinstance(reason, Mapping):
        finish, message = str(reason.get("type", "")), str(reason.get("message") or "")
    else:
        finish, message = str(reason or ""), ""
    if finish not in ("stop", "length", "abort"):
        raise ValueError(f"engine returned an unknown finish_reason {reason!r}")
    verify = int(meta.get("spec_verify_ct") or 0)
    if not verify:
        return Segment(tokens, logprobs, finish, message, plain_steps=len(tokens))
    n = len(tokens)
    accepted = next(
        (
            int(meta[k])
            for k in ("spec_num_correct_drafts", "spec_accepted_drafts", "spec_accept_token_num")
            if meta.get(k) is not None
        ),
        max(0, n - 1 - verify),
    )
    plain = max(0, n - accepted - verify)
    return Segment(tokens, logprobs, finish, message, verify, accepted, plain)


def finish_reason(segment: Segment, *, cancelled: bool) -> tuple[FinishReason, str]:
    """(our finish reason, error). An abort we asked for is a cancel; one SGLang decided on
    (a request it rejected, an engine error) fails the sample with SGLang's message."""
    if segment.finish == "stop":
        return FinishReason.STOP, ""
    if segment.finish == "length":
        return FinishReason.LENGTH, ""
    if cancelled:
        return FinishReason.CANCELLED, ""
    return FinishReason.FAILED, f"sglang aborted the request: {segment.message or 'no reason'}"
