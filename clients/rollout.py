"""RolloutClient / AsyncRolloutClient: the trainer's view of tltd, in plain Python values."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc

from tltd.api import convert
from tltd.domain import (
    FinishReason,
    LogprobMode,
    PromptLogprobs,
    SamplingParams,
    SpeculativeMode,
    TokenProvenance,
    TokenSource,
    TopLogprobs,
)
from tltd.errors import TltError
from tltd.v1 import (
    common_pb2,
    job_pb2,
    job_pb2_grpc,
    policy_pb2,
    policy_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
)
from tltd_clients.client import (
    CLIENT_TIMEOUT,
    DEFAULT_TARGET,
    ClientTimeout,
    TltClient,
    channel_credentials,
)
from tltd_clients.endpoints import (
    KEEPALIVE,
    RETRYABLE,
    Backoff,
    Delivered,
    Failover,
    Rotation,
    channel_options,
    split_targets,
)
from tltd_clients.errors import (
    DeadlineExceededError,
    NotFoundError,
    TltClientError,
    UnavailableError,
    from_rpc_error,
)

__all__ = [
    "AsyncRolloutClient",
    "JobInfo",
    "RolloutClient",
    "RolloutSample",
    "SamplingParams",
    "TokenProvenance",
    "TokenSource",
    "by_prompt",
]

_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# A stream that ends with these was given up on by this side: the daemon still runs the work.
_GIVEN_UP = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
_CANCEL_TIMEOUT = 5.0
_CANCEL_RETRY_SECONDS = 0.1
_ABANDONED = "abandoned by the client (stopped reading the stream, or timed out)"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutSample:
    """One finished sample: what a trainer needs to score it and compute its loss."""

    request_id: str
    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]  # the target's logprob of each output token (per logprob_mode)
    finish_reason: FinishReason  # a StrEnum: compares equal to "stop", "length", ...
    policy_version: int
    drafter_version: int  # 0 = no learned drafter was used
    # Per-row SD counters (docs/sd-statistics.md); the first token is from the prefill.
    draft_steps: int = 0  # decode steps in which this sample verified >= 1 draft token
    plain_steps: int = 0  # decode steps that gave it one token without a draft
    accepted_tokens: int = 0
    mean_accepted_length: float = 0.0  # tokens per SD step (accepted + 1); 0 without SD
    partial: bool = False  # aborted (drain / preemption) before stop or length
    error: str = ""
    drafted_tokens: int = 0  # draft tokens verified
    bonus_tokens: int = 0  # drawn from p after a fully accepted chain
    residual_tokens: int = 0  # drawn from the residual after a rejected draft
    provenance: list[TokenProvenance] | None = None  # per token, with return_provenance=True
    # Per token its most likely alternatives, with top_logprobs=N > 0.
    top_logprobs: list[TopLogprobs] | None = None
    # The prompt's tokens scored by the target, with prompt_logprobs=N (0 included).
    prompt_logprobs: PromptLogprobs | None = None
    # The prompt a carried group answers (an earlier request's: bound_groups with carried);
    # empty for the call's own prompts (`prompt_index` names it).
    prompt_token_ids: list[int] = field(default_factory=list)
    # (first token index, policy version) per version that produced its tokens, when more
    # than one did (asynchronous RL: docs/rollouts.md); empty = all from `policy_version`.
    policy_spans: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def sd_step_share(self) -> float:
        """Share of this sample's decode steps that verified a draft (0 without steps)."""
        steps = self.draft_steps + self.plain_steps
        return self.draft_steps / steps if steps else 0.0


# RolloutSample's fields copied as they are from the domain sample (the rest are lists).
_SAMPLE_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(RolloutSample)
    if f.name
    not in (
        "token_ids",
        "logprobs",
        "provenance",
        "top_logprobs",
        "prompt_token_ids",
        "policy_spans",
    )
)


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    model_path: str
    status: str  # "active" | "cancelled" | "failed"
    policy_version: int
    drafter_version: int
    speculative: str  # "auto" | "off"


def by_prompt(samples: Iterable[RolloutSample]) -> list[list[RolloutSample]]:
    """Samples grouped per prompt (index order), each group in sample-index order: GRPO's
    groups. A bounded call's carried groups (other requests' prompts) are groups of their own,
    by request id then prompt index."""
    groups: dict[tuple[str, int], list[RolloutSample]] = {}
    for s in samples:
        groups.setdefault((s.request_id, s.prompt_index), []).append(s)
    return [sorted(groups[k], key=lambda s: s.sample_index) for k in sorted(groups)]


# ---- proto <-> plain values (the daemon's converter, `tltd.api.convert`) ------------------


def _sample_from_pb(pb: rollout_pb2.Sample) -> RolloutSample:
    """A finish reason this client does not know yet is reported as a failure (not dropped);
    an unknown token source or drafter kind fails loudly (ValueError)."""
    try:
        s = convert.sample_from_pb(pb)
    except TltError as exc:
        raise ValueError(f"{exc}: update tltd") from None
    # The domain sample's fields, its speculative counters flattened in (same names).
    values = {**_fields(s.speculative), **_fields(s)}
    return RolloutSample(
        **{name: values[name] for name in _SAMPLE_FIELDS},
        token_ids=list(s.token_ids),
        logprobs=list(s.logprobs),
        provenance=None if s.provenance is None else list(s.provenance),
        top_logprobs=None if s.top_logprobs is None else list(s.top_logprobs),
        prompt_token_ids=list(s.prompt_token_ids),
        policy_spans=[tuple(x) for x in s.policy_spans],
    )


def _fields(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _job_info_from_pb(pb: job_pb2.Job) -> JobInfo:
    """The client's own reader: `tltd.api.convert` only writes a Job (the daemon never reads
    one), and JobInfo is the trainer's summary of it in plain strings."""
    status = job_pb2.JobStatus.Name(pb.status).removeprefix("JOB_STATUS_").lower()
    mode = "off" if pb.speculative.mode == common_pb2.SPECULATIVE_MODE_OFF else "auto"
    return JobInfo(pb.job_id, pb.model_path, status, pb.policy_version, pb.drafter_version, mode)


def _speculative_mode(value: str | None) -> int:
    key = value.lower() if isinstance(value, str) else value
    if key is not None and key not in set(SpeculativeMode):  # a StrEnum: "off" is OFF
        raise ValueError(f"speculative must be 'auto', 'off' or None, got {value!r}")
    return convert.speculative_mode_to_pb(None if key is None else SpeculativeMode(key))


def _sampling(
    n: int | None, sampling: SamplingParams | None, overrides: dict[str, Any]
) -> SamplingParams:
    unknown = set(overrides) - _SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    params = dataclasses.replace(sampling or SamplingParams(), **overrides)
    if n is not None:
        params = dataclasses.replace(params, n=n)
    # The wire cannot tell n=0 from unset (the daemon would read it as 1): refuse it here.
    if params.n < 1:
        raise ValueError(f"n must be >= 1 (samples per prompt), got {params.n}")
    if params.logprob_mode not in set(LogprobMode):  # a StrEnum: "raw" is LogprobMode.RAW
        raise ValueError(f"logprob_mode must be 'processed' or 'raw', got {params.logprob_mode!r}")
    return dataclasses.replace(params, logprob_mode=LogprobMode(params.logprob_mode))


def _policy_switch(value: str) -> int:
    names = {
        "finish_on_start_version": job_pb2.POLICY_SWITCH_FINISH_ON_START_VERSION,
        "next_step": job_pb2.POLICY_SWITCH_NEXT_STEP,
    }
    if value not in names:
        raise ValueError(f"policy_switch must be one of {', '.join(names)}, got {value!r}")
    return names[value]


def _new_request_id() -> str:
    """A fresh id per call, so that the daemon can dedupe retries and the client can cancel."""
    return f"req-{uuid.uuid4().hex}"


def _generate_request(
    job_id: str,
    prompts: Iterable[Sequence[int]],
    sampling: SamplingParams,
    request_id: str | None,
    speculative: str | None,
    return_partial: bool = False,
    bound: tuple[int, bool, bool, float | None, int] = (0, False, False, None, 0),
) -> rollout_pb2.GenerateRequest:
    groups, carried, park, deadline, max_tokens = bound
    deadline_ms = 0 if deadline is None else max(1, round(deadline * 1000))
    return rollout_pb2.GenerateRequest(
        job_id=job_id,
        request_id=request_id or "",
        prompts=[rollout_pb2.Prompt(token_ids=[int(t) for t in p]) for p in prompts],
        sampling=convert.sampling_to_pb(sampling),
        speculative=_speculative_mode(speculative),
        return_partial=return_partial,
        batch_samples=True,
        bound=rollout_pb2.StepBound(
            groups=groups, carried=carried, park=park, deadline_ms=deadline_ms,
            max_tokens=max_tokens,
        ),  # fmt: skip
    )


def _in_order(samples: Iterable[RolloutSample]) -> list[RolloutSample]:
    """(prompt, sample) order, one per sample: a complete sample replaces the partial one a
    drained endpoint delivered before the stream moved on. A bounded call's carried samples
    (other requests') sort by request id first."""
    by_key: dict[tuple[str, int, int], RolloutSample] = {}
    for s in samples:
        key = (s.request_id, s.prompt_index, s.sample_index)
        if key not in by_key or by_key[key].finish_reason == FinishReason.ABORTED:
            by_key[key] = s
    return [by_key[k] for k in sorted(by_key)]


def _remaining(deadline: float | None, request_id: str) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceededError(
            grpc.StatusCode.DEADLINE_EXCEEDED, f"request {request_id}: timeout passed"
        )
    return left


# ---- the core both clients share: requests, failover and responses, without I/O ------------


@dataclass(frozen=True)
class _Unary:
    """One unary call: `service` names the stub (a TltClient attribute), `then` turns the
    response into what the caller gets."""

    what: str
    service: str  # "jobs" | "rollouts" | "policy"
    method: str
    request: Any
    then: Callable[[Any], Any]


class _Attempts:
    """One call's endpoints: the first by round-robin, the next after each UNAVAILABLE."""

    def __init__(self, rotation: Rotation, failover: Failover) -> None:
        self.rotation = rotation
        self.failover = failover
        self.index = rotation.start(time.monotonic())

    def delay(self, target: str, err: TltClientError, received: int = 0) -> float:
        """The wait before the next endpoint (AllEndpointsUnavailableError once spent)."""
        return self.failover.next_delay(target, err, received)

    def next_endpoint(self) -> None:
        self.index = self.rotation.after(self.index, time.monotonic())


class _Stream(_Attempts):
    """One Generate stream over failovers: which samples are new, when to retry, and whether
    the caller gave up (then the request is cancelled: closing only detaches, and the daemon
    would keep the work for a retry)."""

    def __init__(self, rotation: Rotation, failover: Failover, req, timeout: float | None):
        super().__init__(rotation, failover)
        self.request_id = req.request_id
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.delivered = Delivered()
        # Until the stream ends: break, close(), garbage collection, Ctrl-C, task cancelled.
        self.given_up = True

    def time_left(self) -> float | None:
        return _remaining(self.deadline, self.request_id)

    def admit(self, resp: rollout_pb2.GenerateResponse) -> list[RolloutSample]:
        """The response's samples the caller does not have yet (one in `sample`, or those in
        `samples`: the request asks for them batched, a daemon that predates that sends one)."""
        pbs = resp.samples if len(resp.samples) else (resp.sample,)
        new = [x for x in map(_sample_from_pb, pbs) if self.delivered.admit(x)]
        if new:
            self.failover.progress()
        return new

    def ended(self) -> None:
        self.given_up = False

    def failed(self, exc: grpc.RpcError, target: str) -> float:
        """The wait before the stream is re-sent to the next endpoint; a failure that is not
        retried is raised as the client's typed error."""
        err = from_rpc_error(exc)
        if exc.code() not in RETRYABLE:
            self.given_up = exc.code() in _GIVEN_UP
            raise err from None
        self.given_up = False  # unreachable: nothing to cancel there
        delay = self.delay(target, err, len(self.delivered))
        self.given_up = True
        return min(delay, self.time_left() or delay)


class _CancelRetry:
    """Cancelling an abandoned request: NOT_FOUND is retried for a while, as the daemon may
    still be storing the request (its admission completes even when the caller has left)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.deadline = time.monotonic() + _CANCEL_TIMEOUT

    def again(self, exc: Exception) -> bool:
        if isinstance(exc, NotFoundError) and time.monotonic() < self.deadline:
            return True
        # finished already, channel closed, or NOT_FOUND for too long
        log.debug("could not cancel abandoned request %s: %s", self.request_id, exc)
        return False


@dataclass(frozen=True)
class _Tls:
    on: bool
    ca: str | None
    cert: str | None
    key: str | None


# What a method returns: the value (RolloutClient) or an awaitable of it (AsyncRolloutClient).
_JobR = TypeVar("_JobR")
_IntR = TypeVar("_IntR")
_NoneR = TypeVar("_NoneR")
_SamplesR = TypeVar("_SamplesR")
_StreamR = TypeVar("_StreamR")


class _RolloutCore(Generic[_JobR, _IntR, _NoneR, _SamplesR, _StreamR]):
    """The trainer's calls, written once: each builds its request and reads its response; the
    sync and async clients only carry them (`_unary`, `_samples`, `_in_order_of`).

    The job a client talks about (given at construction or set by create_job) and the
    endpoints it talks to (one, a list in round-robin, or a gRPC resolver target)."""

    job_id: str | None
    targets: list[str]
    retries: int
    backoff: Backoff
    _rotation: Rotation
    last_request_id: str | None = None  # the id of the newest stream/generate call

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        job_id: str | None = None,
        *,
        token: str | None = None,
        tls: bool = False,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        timeout: float | None = 30.0,
        retries: int | None = None,
        backoff: Backoff | None = None,
        keepalive: float | None = KEEPALIVE,
    ) -> None:
        self.job_id = job_id
        self.timeout = timeout
        self._bind(target, retries, backoff)
        self._open(token, _Tls(tls, tls_ca, tls_cert, tls_key), keepalive)

    def _job(self, job_id: str | None) -> str:
        job = job_id or self.job_id
        if not job:
            raise ValueError("no job: pass job_id, construct with job_id=..., or create_job()")
        return job

    def _bind(self, target: str | Sequence[str], retries: int | None, backoff: Backoff | None):
        self.targets = split_targets(target)
        # Default: every endpoint twice, at least 3 tries of a lone daemon (a restart).
        self.retries = max(3, 2 * len(self.targets)) if retries is None else retries
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        self.backoff = backoff or Backoff()
        self._rotation = Rotation(len(self.targets))

    def _attempts(self, what: str) -> _Attempts:
        return _Attempts(self._rotation, Failover(self.retries, self.backoff, what))

    def _stream_run(self, req: rollout_pb2.GenerateRequest, timeout: float | None) -> _Stream:
        what = f"Generate request {req.request_id}"
        return _Stream(self._rotation, Failover(self.retries, self.backoff, what), req, timeout)

    # -- carried by each client -----------------------------------------------------------------

    def _open(self, token: str | None, tls: _Tls, keepalive: float | None) -> None:
        raise NotImplementedError

    def _unary(self, call: _Unary) -> Any:
        raise NotImplementedError

    def _samples(self, req: rollout_pb2.GenerateRequest, timeout: float | None) -> _StreamR:
        raise NotImplementedError

    def _in_order_of(self, samples: _StreamR) -> _SamplesR:
        raise NotImplementedError

    # -- the calls ------------------------------------------------------------------------------

    def create_job(
        self,
        model_path: str | Path,
        *,
        job_id: str = "",
        name: str = "",
        priority: int = 0,
        weight: float = 0.0,
        speculative: str | None = "auto",
        online_training: bool = True,
        batch_threshold: int = 0,
        initial_drafter: str | Path | None = None,
        policy_switch: str = "finish_on_start_version",
        max_staleness: int | None = None,
        backend: str = "",
    ) -> _JobR:
        """Create (idempotently, when job_id is given) a job; this client then uses it.

        `initial_drafter`: an offline-fitted EAGLE drafter directory (as
        `EagleDrafter.save_pretrained` / scripts/fit_drafter.py write) the job starts from as
        its drafter version 1; needs speculative "auto" (a learned drafter).
        `policy_switch` "next_step": running samples move to a new policy version between
        decode steps (asynchronous RL); `max_staleness`: a bounded call never returns a group
        with a token more than this many versions old (docs/rollouts.md). `backend` "torch",
        "sglang" or "sim" (the simulated engine, docs/backends.md); "": the daemon's default."""
        spec = common_pb2.SpeculativeConfig(
            mode=_speculative_mode(speculative),
            batch_threshold=batch_threshold,
            online_training=online_training,
            initial_drafter_path=str(initial_drafter) if initial_drafter else "",
        )
        req = job_pb2.CreateJobRequest(
            job_id=job_id,
            name=name,
            model_path=str(model_path),
            priority=priority,
            weight=weight,
            speculative=spec,
            policy_switch=_policy_switch(policy_switch),
            max_staleness=max_staleness,
            backend=common_pb2.Backend.Value(f"BACKEND_{backend.upper()}") if backend else 0,
        )
        return self._unary(_Unary("CreateJob", "jobs", "CreateJob", req, self._use_job))

    def _use_job(self, pb: job_pb2.Job) -> JobInfo:
        info = _job_info_from_pb(pb)
        self.job_id = info.job_id
        return info

    def job(self, job_id: str | None = None) -> _JobR:
        req = job_pb2.GetJobRequest(job_id=self._job(job_id))
        return self._unary(_Unary("GetJob", "jobs", "GetJob", req, _job_info_from_pb))

    def stream(
        self,
        prompts: Iterable[Sequence[int]],
        n: int | None = None,
        *,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        speculative: str | None = None,
        job_id: str | None = None,
        timeout: float | None = None,
        return_partial: bool = False,
        bound_groups: int = 0,
        carried: bool = False,
        park: bool = False,
        deadline: float | None = None,
        max_tokens: int = 0,
        **sampling_kwargs: Any,
    ) -> _StreamR:
        """Yield samples the moment they finish (finish order); an async iterator on the
        AsyncRolloutClient. Arguments as for generate(). Arguments are checked at once; the
        rollout starts at the first next().

        `return_partial`: when a node running a sample is drained and hands it to another
        node, also yield its tokens so far (finish_reason ABORTED, partial=True) before the
        complete sample, which has the same (prompt_index, sample_index) and replaces it.
        Without it each sample is yielded once.

        `bound_groups` (asynchronous RL, docs/rollouts.md): yield whole groups only, and end
        once this many were yielded; the other prompts keep running, and a later call with
        `carried=True` yields their groups (counted toward its own bound) before its own.
        `park=True`: at the bound the other prompts pause instead, their tokens stored, and
        go on when the next call with `carried=True` is accepted. `deadline` (seconds from
        acceptance): end then even with fewer groups. `max_tokens`: a token budget per sample
        for this step; a sample that reaches it pauses and its prompt parks (as with `park`)
        once its other samples are done or paused."""
        params = _sampling(n, sampling, sampling_kwargs)
        rid = request_id or _new_request_id()
        req = _generate_request(
            self._job(job_id), prompts, params, rid, speculative, return_partial,
            (bound_groups, carried, park, deadline, max_tokens),
        )  # fmt: skip
        self.last_request_id = rid
        return self._samples(req, timeout)

    def generate(
        self,
        prompts: Iterable[Sequence[int]],
        n: int | None = None,
        *,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        speculative: str | None = None,
        job_id: str | None = None,
        timeout: float | None = None,
        bound_groups: int = 0,
        carried: bool = False,
        park: bool = False,
        deadline: float | None = None,
        max_tokens: int = 0,
        **sampling_kwargs: Any,
    ) -> _SamplesR:
        """Roll out `n` samples of every prompt (token ids); all samples, in (prompt, sample)
        order, once the last has finished.

        Sampling: `sampling=SamplingParams(...)` and/or its fields as keywords (temperature,
        top_p, top_k, max_new_tokens, stop_token_ids, seed, logprob_mode "processed" (default)
        or "raw", return_provenance); keywords win. `speculative`:
        "auto" (adaptive SD), "off", or None (the job's mode). `request_id` (default: a fresh
        one, see `last_request_id`) makes a retry attach to the same work. No overall timeout
        unless given: rollouts run long; when it passes, the request is cancelled and
        DeadlineExceededError raised. `bound_groups`, `carried`, `park`, `deadline`,
        `max_tokens`: see stream(); the samples
        are then those of the groups yielded (`by_prompt` groups them).
        """
        samples = self.stream(
            prompts,
            n,
            sampling=sampling,
            request_id=request_id,
            speculative=speculative,
            job_id=job_id,
            timeout=timeout,
            bound_groups=bound_groups,
            carried=carried,
            park=park,
            deadline=deadline,
            max_tokens=max_tokens,
            **sampling_kwargs,
        )
        return self._in_order_of(samples)

    def cancel(self, request_id: str, reason: str = "") -> _NoneR:
        req = rollout_pb2.CancelRequestRequest(request_id=request_id, reason=reason)
        return self._unary(_Unary("CancelRequest", "rollouts", "CancelRequest", req, _nothing))

    def update_policy(
        self, checkpoint_dir: str | Path, *, note: str = "", job_id: str | None = None
    ) -> _IntR:
        """Push new weights (a Hugging Face checkpoint directory the daemon can read); returns
        the new policy version, which samples generated from now on carry.

        Retried on the next endpoint on UNAVAILABLE like every call: a connection lost after
        the daemon recorded the version can record the same checkpoint twice (two versions,
        the same weights)."""
        req = policy_pb2.UpdatePolicyRequest(
            job_id=self._job(job_id),
            checkpoint=policy_pb2.CheckpointSource(path=str(checkpoint_dir)),
            note=note,
        )
        return self._unary(_Unary("UpdatePolicy", "policy", "UpdatePolicy", req, _version))


def _nothing(pb: Any) -> None:
    return None


def _version(pb: policy_pb2.UpdatePolicyResponse) -> int:
    return int(pb.policy.version)


# ---- synchronous ---------------------------------------------------------------------------


class RolloutClient(_RolloutCore[JobInfo, int, None, list[RolloutSample], Iterator[RolloutSample]]):
    """Synchronous rollout client for trainers.

        client = RolloutClient("127.0.0.1:50051")
        client.create_job("models/tiny-policy", job_id="grpo-1")
        samples = client.generate(prompts, n=8, temperature=1.0, max_new_tokens=512)
        version = client.update_policy("ckpt/step-1")

    Failures raise the typed errors of `tltd_clients.errors` (InvalidArgumentError naming the
    field, NotFoundError, UnavailableError while the daemon drains, DeadlineExceededError
    when a `timeout` passes, ...); bad arguments that never reach the daemon (an unknown
    `speculative` mode or sampling field, n < 1) raise ValueError / TypeError.

    Every rollout has a request id (yours, or a fresh one: `last_request_id`, and each
    sample's `request_id`). A caller that gives up on a rollout (stops iterating a stream,
    closes it, or hits its timeout) cancels the request on the daemon; to re-attach to
    running work after a lost connection, call again with the same `request_id`.

    Several daemons: `target` may be a list of endpoints (or "host:port,host:port"), each
    new call starting on the next one (round-robin), or a gRPC resolver target such as
    `dns:///tltd.example:50051` (one channel, gRPC's `round_robin` over every address). A
    call that fails with UNAVAILABLE (the daemon is down, unreachable or draining; a stream
    broken mid-way) is retried on the next endpoint after a backoff, up to `retries` times
    in a row without progress; a stream is re-sent with the same request id (it re-attaches)
    and never delivers a sample twice. When every retry failed: AllEndpointsUnavailableError
    naming each endpoint's last error. Failovers are logged (logger `tltd_clients.failover`).
    Keepalive pings every `keepalive` seconds (None: off) break a stream whose daemon
    vanished without closing the connection, so that it fails over too.
    """

    def _open(self, token: str | None, tls: _Tls, keepalive: float | None) -> None:
        # One channel per endpoint, with the operator client's auth and error mapping.
        self._raws = [
            TltClient(
                t,
                token,
                tls.ca,
                tls=tls.on,
                tls_cert=tls.cert,
                tls_key=tls.key,
                timeout=self.timeout,
                keepalive=keepalive,
            )
            for t in self.targets
        ]
        self._current = 0

    @property
    def raw(self) -> TltClient:
        """The operator client of the endpoint that served the latest call."""
        return self._raws[self._current]

    def close(self) -> None:
        for raw in self._raws:
            raw.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unary(self, call: _Unary) -> Any:
        """The call on the next endpoint; on UNAVAILABLE on the one after, with backoff."""
        attempts = self._attempts(call.what)
        while True:
            self._current = attempts.index
            raw = self._raws[attempts.index]
            try:
                pb = raw.call(getattr(getattr(raw, call.service), call.method), call.request)
            except UnavailableError as err:
                time.sleep(attempts.delay(raw.target, err))
                attempts.next_endpoint()
                continue
            return call.then(pb)

    def _samples(
        self, req: rollout_pb2.GenerateRequest, timeout: float | None
    ) -> Iterator[RolloutSample]:
        run = self._stream_run(req, timeout)
        try:
            while True:
                self._current = run.index
                raw = self._raws[run.index]
                call = raw.rollouts.Generate(req, metadata=raw._metadata, timeout=run.time_left())
                try:
                    for resp in call:
                        yield from run.admit(resp)
                    run.ended()
                    return
                except grpc.RpcError as exc:
                    time.sleep(run.failed(exc, raw.target))
                    run.next_endpoint()
                finally:
                    call.cancel()
        finally:
            if run.given_up:
                self._cancel_quietly(self._raws[run.index], req.request_id)

    def _cancel_quietly(self, raw: TltClient, request_id: str) -> None:
        retry = _CancelRetry(request_id)
        while True:
            try:
                raw.cancel_request(request_id, _ABANDONED, timeout=_CANCEL_TIMEOUT)
                return
            except (TltClientError, ValueError) as exc:  # ValueError: the channel is closed
                if not retry.again(exc):
                    return
                time.sleep(_CANCEL_RETRY_SECONDS)

    def _in_order_of(self, samples: Iterator[RolloutSample]) -> list[RolloutSample]:
        return _in_order(samples)

    def push_policy(self, weights: Any, *, job_id: str | None = None, **kwargs: Any) -> int:
        """Push new weights in-band (a state dict of torch tensors with HF names, or a
        safetensors file or directory): the daemon needs no access to the trainer's disk.
        Resumable, optionally a delta (`base_version=`, `base_weights=`); see
        `TltClient.push_policy` for the keyword arguments. Returns the new policy version."""
        return int(self.raw.push_policy(self._job(job_id), weights, **kwargs).policy.version)


# ---- asyncio -------------------------------------------------------------------------------

_STUBS = {
    "jobs": job_pb2_grpc.JobServiceStub,
    "rollouts": rollout_pb2_grpc.RolloutServiceStub,
    "policy": policy_pb2_grpc.PolicyServiceStub,
}


class AsyncRolloutClient(
    _RolloutCore[
        Awaitable[JobInfo],
        Awaitable[int],
        Awaitable[None],
        Awaitable[list[RolloutSample]],
        AsyncIterator[RolloutSample],
    ]
):
    """The asyncio twin of RolloutClient (grpc.aio); same methods, awaitable:

    async with AsyncRolloutClient(target) as client:
        await client.create_job(model_dir)
        samples = await client.generate(prompts, n=8)
        async for s in client.stream(prompts, n=8): ...

    The client may be built outside a running loop (e.g. in a trainer's __init__): its
    channels are opened on first use, in the loop that uses them. Request ids, cancellation
    of abandoned streams, errors, several endpoints and failover as for RolloutClient.
    """

    def _open(self, token: str | None, tls: _Tls, keepalive: float | None) -> None:
        self._creds = channel_credentials(tls.on, tls.ca, tls.cert, tls.key)  # checked now
        self._keepalive = keepalive
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channels: list[grpc.aio.Channel] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def _channel(self, index: int) -> grpc.aio.Channel:
        """Endpoint `index`'s channel in the running loop: a grpc.aio channel is bound to the
        loop it was created in, so channels are created lazily (and anew if the client moved
        to another loop)."""
        loop = asyncio.get_running_loop()
        if not self._channels or self._loop is not loop:
            self._channels = [self._connect(t) for t in self.targets]
            self._loop = loop
        return self._channels[index]

    def _connect(self, target: str) -> grpc.aio.Channel:
        options = channel_options(target, self._keepalive)
        if self._creds is None:
            return grpc.aio.insecure_channel(target, options=options)
        return grpc.aio.secure_channel(target, self._creds, options=options)

    async def close(self) -> None:
        channels, self._channels = self._channels, []
        if self._loop is asyncio.get_running_loop():
            for channel in channels:
                await channel.close()

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(
        self, method, request, timeout: float | None | ClientTimeout = CLIENT_TIMEOUT
    ) -> Any:
        if timeout is CLIENT_TIMEOUT:
            timeout = self.timeout
        try:
            return await method(request, metadata=self._metadata, timeout=timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    async def _unary(self, call: _Unary) -> Any:
        """The call on the next endpoint; on UNAVAILABLE on the one after, with backoff."""
        attempts = self._attempts(call.what)
        while True:
            stub = _STUBS[call.service](self._channel(attempts.index))
            try:
                pb = await self._call(getattr(stub, call.method), call.request)
            except UnavailableError as err:
                await asyncio.sleep(attempts.delay(self.targets[attempts.index], err))
                attempts.next_endpoint()
                continue
            return call.then(pb)

    async def _samples(
        self, req: rollout_pb2.GenerateRequest, timeout: float | None
    ) -> AsyncIterator[RolloutSample]:
        run = self._stream_run(req, timeout)
        try:
            while True:
                stub = rollout_pb2_grpc.RolloutServiceStub(self._channel(run.index))
                call = stub.Generate(req, metadata=self._metadata, timeout=run.time_left())
                try:
                    async for resp in call:
                        for sample in run.admit(resp):
                            yield sample
                    run.ended()
                    return
                except grpc.RpcError as exc:
                    await asyncio.sleep(run.failed(exc, self.targets[run.index]))
                    run.next_endpoint()
                finally:
                    call.cancel()
        finally:
            if run.given_up:
                await self._cancel_quietly(run.index, req.request_id)

    async def _cancel_quietly(self, index: int, request_id: str) -> None:
        if not self._channels or self._loop is not asyncio.get_running_loop():
            return  # the client was closed first: nothing to cancel with
        req = rollout_pb2.CancelRequestRequest(request_id=request_id, reason=_ABANDONED)
        stub = rollout_pb2_grpc.RolloutServiceStub(self._channels[index])
        retry = _CancelRetry(request_id)
        while True:
            try:
                await self._call(stub.CancelRequest, req, timeout=_CANCEL_TIMEOUT)
                return
            except (TltClientError, grpc.aio.UsageError) as exc:  # UsageError: closing
                if not retry.again(exc):
                    return
                await asyncio.sleep(_CANCEL_RETRY_SECONDS)

    async def _in_order_of(self, samples: AsyncIterator[RolloutSample]) -> list[RolloutSample]:
        return _in_order([s async for s in samples])
