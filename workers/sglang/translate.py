"""SGLang adapter logic: engine arguments, request and response translation, the engine port.

Pure functions and a `Protocol`; nothing here imports sglang.
`tltd_workers.sglang.engine` holds the one class that talks to a real `sglang.Engine`
(python/sglang/srt/entrypoints/engine.py);
`tltd_workers.rollout.sglang_worker` drives any object with the `SglangEngine` methods. The tests
run that class over a fake `sglang.Engine` (tests/rollout/fake_sglang.py), and check every
SGLang name used here against the real package (tests/sglang_contract/, `make test-sglang`).

What maps to what (SGLang names):
- `LoadModel` -> `sglang.Engine(**engine_args(...))`: token ids in and out
  (`skip_tokenizer_init`), one GPU (`base_gpu_id`), `random_seed`, `max_running_requests`,
  `context_length`, `mem_fraction_static`, `enable_deterministic_inference` (without it
  SGLang ignores per-request seeds); speculation from `EngineSpec` and the drafter
  (`speculative_args`), with the job's batch-size gate and draft lengths as SGLang's
  `speculative_adaptive_config` (`adaptive_config`).
- one sample of an `AddWork` -> one `async_generate(input_ids=..., sampling_params=...,
  return_logprob=True, rid=...)` with `n=1` and its own `sampling_seed`;
- its output dict (`output_ids`, `meta_info.output_token_logprobs`, `meta_info.finish_reason`,
  `meta_info.spec_verify_ct`, `meta_info.weight_version`, ...) -> `Segment` (`read_output`)
  -> `tltd.domain.Sample`;
- `Cancel` -> `tokenizer_manager.abort_request(rid=...)`; drain ->
  `abort_request(abort_all=True)`;
- `LoadPolicy` -> `WeightUpdate(selector="target")`; `SetDrafter` ->
  `WeightUpdate(selector="draft")`: SGLang's selector-scoped weight update
  (`begin_weight_update(selector)`, `UpdateWeightsFromTensorReqInput(selector=...)`,
  `end_weight_update()`), each tagged with the policy version as `weight_version`.
- `JoinBroadcast` -> `DistributedJoin` (`distributed_join`): SGLang's distributed weight
  update, in one target-scoped session: `init_weights_update_group(master_address,
  master_port, rank_offset, world_size, group_name, backend)`,
  `update_weights_from_distributed(names, dtypes, shapes, group_name, ...)` without a
  `weight_version` (the version does not exist yet), `destroy_weights_update_group`; the
  LoadPolicy of the recorded version then only sets it (`update_weight_version`).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from tltd.contract.broadcast import SGLANG_TP_SIZE
from tltd.contract.rollout_messages import EngineSpec, JoinBroadcast
from tltd.domain import FinishReason, SamplingParams, TensorSpec

Selector = Literal["target", "draft"]

# SGLang sizes its KV cache to this share of GPU memory at start. Not its default (~0.8-0.9):
# the drafter trainer runs on this same device when rollout goes idle, and needs room.
MEM_FRACTION_STATIC = 0.7

# One worker per device (`tltd.contract.broadcast`: a broadcast's ranks follow it).
TP_SIZE = SGLANG_TP_SIZE

# Seeds stay below 2**31 - 1 so that they fit any int32 path SGLang's sampler may take.
_SEED_MODULUS = 2**31 - 1


@dataclass(frozen=True)
class WeightUpdate:
    """New weights from a checkpoint directory, for the target (policy) or the draft model.
    `weight_version` is what SGLang reports as `meta_info.weight_version` from then on: the
    policy version, also for a draft update (the draft does not change the policy)."""

    path: str
    selector: Selector
    weight_version: str = ""


@dataclass(frozen=True)
class DistributedJoin:
    """One engine's part in a policy broadcast: the group (the daemon's TCP store, SGLang's
    `rank_offset` = the engine's first rank) and the tensors, in the order the trainer
    broadcasts them; dtypes as torch names ("bfloat16"), as SGLang takes them."""

    address: str
    port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]


def distributed_join(m: JoinBroadcast) -> DistributedJoin:
    """A JoinBroadcast as SGLang's distributed weight update takes it."""
    names = tuple(name for name, _, _ in m.tensors)
    dtypes = tuple(TensorSpec.TORCH_DTYPES[code] for _, code, _ in m.tensors)
    shapes = tuple(tuple(shape) for _, _, shape in m.tensors)
    return DistributedJoin(
        m.address, m.port, m.rank, m.world_size, m.group_name, m.backend, names, dtypes, shapes
    )


class SglangEngine(Protocol):
    """The engine port: what the worker needs of an SGLang engine, one method per SGLang call
    (`tltd_workers.sglang.engine.SglangEngineAdapter` is the real one)."""

    def submit(self, rid: str, input_ids: Sequence[int], sampling_params: dict[str, Any]) -> None:
        """Start one generation (`async_generate(..., return_logprob=True, rid=rid)`)."""
        ...

    def poll(self, timeout: float) -> list[tuple[str, dict[str, Any]]]:
        """(rid, output dict) of the generations that ended within `timeout` seconds."""
        ...

    def abort(self, rid: str) -> None:
        """Stop a generation (`tokenizer_manager.abort_request(rid=rid)`): it ends soon with
        finish_reason "abort" and the tokens it had, also when it was submitted but SGLang
        has not registered it yet."""
        ...

    def abort_all(self) -> None:
        """Stop every generation (`tokenizer_manager.abort_request(abort_all=True)`)."""
        ...

    def update_weights(self, update: WeightUpdate) -> bool:
        """Load new weights in place: True when applied, False when this engine cannot update
        `update.selector` in place (the caller restarts it); raises when loading failed."""
        ...

    def start_broadcast(self, join: DistributedJoin) -> None:
        """Join a policy broadcast and receive its tensors into the target weights, while
        `poll` runs the engine's loop (`init_weights_update_group`,
        `update_weights_from_distributed` in a target-scoped session,
        `destroy_weights_update_group`); no request may run in the engine meanwhile."""
        ...

    def broadcast_result(self) -> tuple[bool, str] | None:
        """None while the broadcast runs; then once (ok, message): ok means the target holds
        every tensor of it (with the weight version unchanged)."""
        ...

    def set_weight_version(self, version: str) -> None:
        """Label the loaded weights (`update_weight_version`): what `meta_info.weight_version`
        reports from then on."""
        ...

    def release_memory(self) -> None:
        """While no request runs: free the GPU memory of the KV cache and the weights
        (`release_memory_occupation`); the next request or update takes it back."""
        ...

    def resume_memory(self) -> None:
        """Take the released memory back (`resume_memory_occupation`); no-op otherwise."""
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


def speculative_args(
    spec: EngineSpec, drafter_path: str = "", adaptive_path: str = ""
) -> dict[str, Any]:
    """SGLang's speculative arguments for a job's speculative config and its drafter.

    - spec_mode "off" -> none.
    - a learned drafter (an SGLang EAGLE checkpoint at `drafter_path`) with drafter "eagle" or
      "auto" -> EAGLE as one chain (topk 1) of up to the longest draft length. With
      `adaptive_path` (a file holding `adaptive_config(spec)`), SGLang's adaptive speculation
      picks the number of steps per batch-size bucket from the observed acceptance, and
      speculates no more above the job's batch threshold.
    - no learned drafter yet: "auto" and "ngram" -> SGLang's model-free NGRAM drafter (as our
      n-gram drafter, it is free from step 0; SGLang adapts EAGLE only); "eagle" -> none
      until a drafter arrives. "history" -> NGRAM too: SGLang's n-gram cache spans requests,
      the nearest it has to drafting from a prompt's earlier answers.
    """
    if spec.spec_mode == "off":
        return {}
    steps = max(spec.draft_lengths) if spec.draft_lengths else 4
    if drafter_path and spec.drafter in ("eagle", "auto"):
        args: dict[str, Any] = {
            "speculative_algorithm": "EAGLE",
            "speculative_draft_model_path": drafter_path,
            "speculative_num_steps": steps,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": steps + 1,
        }
        if adaptive_path:
            args |= {"speculative_adaptive": True, "speculative_adaptive_config": adaptive_path}
        return args
    if spec.drafter in ("ngram", "auto", "history"):
        return {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": steps + 1}
    return {}


def adaptive_config(spec: EngineSpec) -> dict[str, dict[str, Any]]:
    """The job's gate and draft lengths as SGLang's `speculative_adaptive_config`: buckets
    keyed by their smallest batch size. Up to `batch_threshold` running requests: the draft
    lengths ("adaptive": SGLang picks among them from each bucket's acceptance EMA; "fixed":
    the longest only); above it: 0 steps, speculative decoding off at large batches. SGLang
    has no cost model nor strategy bandit: the "measured" gate runs as this threshold."""
    lengths = sorted(set(spec.draft_lengths)) or [4]
    small = lengths if spec.spec_mode == "adaptive" else [lengths[-1]]
    return {
        "1": {"candidate_steps": small},
        str(spec.batch_threshold + 1): {"candidate_steps": [0]},
    }


def engine_args(
    spec: EngineSpec,
    model_path: str,
    drafter_path: str = "",
    adaptive_path: str = "",
    policy_version: int = 0,
) -> dict[str, Any]:
    """`sglang.Engine(**kwargs)` for a job's model (and drafter) on `spec.device`; the
    policy version is SGLang's `weight_version` until a weight update sets another."""
    return {
        "model_path": model_path,
        "weight_version": str(policy_version),
        "skip_tokenizer_init": True,  # token ids in, token ids out: no tokenizer needed
        "base_gpu_id": gpu_index(spec.device),
        "tp_size": TP_SIZE,
        "random_seed": spec.seed,
        "max_running_requests": spec.max_batch,  # the scheduler's capacity for this worker
        "context_length": spec.max_seq_len,
        "mem_fraction_static": MEM_FRACTION_STATIC,
        # SGLang reads a request's sampling_seed only in deterministic mode; the daemon's
        # retries rely on a sample drawing the same tokens again.
        "enable_deterministic_inference": True,
        # Lets the worker hand the GPU to the drafter trainer while it has no rollouts
        # (release/resume_memory_occupation).
        "enable_memory_saver": True,
        "enable_weights_cpu_backup": True,
        "log_level": "error",
    } | speculative_args(spec, drafter_path, adaptive_path)


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
    between the sibling requests, so this costs no extra prefill).

    Stop ids: SGLang checks `stop_token_ids` only without `ignore_eos`, and then also stops
    at the model's EOS ids. The trainer owns the stop set (as on the torch engine), so a
    sample that stopped on an id outside it is continued by the worker
    (`stopped_outside`). Without stop ids, `ignore_eos` runs the sample to its length."""
    params: dict[str, Any] = {
        "n": 1,
        "temperature": sampling.temperature,  # SGLang: 0 -> greedy (top_k 1)
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,  # SGLang: -1 = whole vocab
        "max_new_tokens": max_new_tokens,
    }
    if sampling.stop_token_ids:
        params["stop_token_ids"] = sorted(set(sampling.stop_token_ids))
    else:
        params["ignore_eos"] = True
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def stopped_outside(segment: Segment, stop_token_ids: Sequence[int]) -> bool:
    """SGLang stopped the segment on a token the caller did not ask to stop at (the model's
    EOS): the sample goes on."""
    return (
        segment.finish == "stop"
        and bool(segment.token_ids)
        and segment.token_ids[-1] not in stop_token_ids
    )


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
    drafted: int = 0  # draft tokens verified (`spec_num_proposed_drafts`)
    # tokens gained per verify pass -> passes (`spec_correct_drafts_histogram`, shifted by 1)
    accepted_lengths: tuple[tuple[int, int], ...] = ()
    weight_version: str = ""  # the weights it started with (SGLang's first version span)


def read_output(out: Mapping[str, Any]) -> Segment:
    """An `async_generate` output dict -> Segment.

    `output_token_logprobs` is [(logprob, token_id, text|None), ...], one per output id; its
    ids must be the output ids (else the logprobs would belong to other tokens). Speculative
    counters: `spec_verify_ct` verify passes; accepted drafts from `spec_num_correct_drafts`
    (older releases: `spec_accepted_drafts`, `spec_accept_token_num`), else derived: each pass
    gains accepted + 1 tokens and the first token comes from prefill; `spec_num_proposed_drafts`
    and `spec_correct_drafts_histogram` where SGLang reports them.
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
    # `weight_versions` spans: the versions a weight update mid-request split it into; the
    # first is what it started with (the torch engine labels a sample by that one too).
    spans = meta.get("weight_versions") or ()
    version = spans[0].get("version") if spans else meta.get("weight_version")
    version = "" if version is None else str(version)
    verify = int(meta.get("spec_verify_ct") or 0)
    if not verify:
        return Segment(
            tokens, logprobs, finish, message, plain_steps=len(tokens), weight_version=version
        )
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
    histogram = meta.get("spec_correct_drafts_histogram") or ()
    lengths = tuple((k + 1, int(c)) for k, c in enumerate(histogram) if c)
    drafted = int(meta.get("spec_num_proposed_drafts") or 0)
    return Segment(
        tokens, logprobs, finish, message, verify, accepted, plain, drafted, lengths, version
    )


@dataclass
class StepCounters:
    """Engine counters over finished segments, summarized in the shape `EngineStats.summary()`
    gives the metrics (`steps`, `accepted_length_hist`): per-sample verify passes and plain
    tokens, and tokens gained per verify pass."""

    plain: int = 0
    spec: int = 0
    hist: Counter[int] = field(default_factory=Counter)

    def add(self, seg: Segment) -> None:
        self.plain += seg.plain_steps
        self.spec += seg.spec_steps
        for length, count in seg.accepted_lengths:
            self.hist[length] += count

    def summary(self) -> dict[str, Any]:
        return {
            "steps": {"plain": self.plain, "spec": self.spec},
            "accepted_length_hist": dict(sorted(self.hist.items())),
        }


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
