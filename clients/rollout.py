"""RolloutClient / AsyncRolloutClient: the trainer's view of tltd, in plain Python values."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from tltd.api import convert
from tltd.domain import FinishReason, LogprobMode, SamplingParams, TokenProvenance, TokenSource
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

_SPECULATIVE = {
    None: common_pb2.SPECULATIVE_MODE_UNSPECIFIED,
    "auto": common_pb2.SPECULATIVE_MODE_AUTO,
    "off": common_pb2.SPECULATIVE_MODE_OFF,
}
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
    if f.name not in ("token_ids", "logprobs", "provenance")
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
    """Samples grouped per prompt (index order), each group in sample-index order: GRPO's groups."""
    groups: dict[int, list[RolloutSample]] = {}
    for s in samples:
        groups.setdefault(s.prompt_index, []).append(s)
    return [sorted(groups[i], key=lambda s: s.sample_index) for i in sorted(groups)]


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
    )


def _fields(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _job_from_pb(pb: job_pb2.Job) -> JobInfo:
    status = job_pb2.JobStatus.Name(pb.status).removeprefix("JOB_STATUS_").lower()
    mode = "off" if pb.speculative.mode == common_pb2.SPECULATIVE_MODE_OFF else "auto"
    return JobInfo(pb.job_id, pb.model_path, status, pb.policy_version, pb.drafter_version, mode)


def _speculative_mode(value: str | None) -> int:
    key = value.lower() if isinstance(value, str) else value
    if key not in _SPECULATIVE:
        raise ValueError(f"speculative must be 'auto', 'off' or None, got {value!r}")
    return _SPECULATIVE[key]


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
) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        job_id=job_id,
        request_id=request_id or "",
        prompts=[rollout_pb2.Prompt(token_ids=[int(t) for t in p]) for p in prompts],
        sampling=convert.sampling_to_pb(sampling),
        speculative=_speculative_mode(speculative),
        return_partial=return_partial,
    )


def _create_job_request(
    model_path: str | Path,
    job_id: str,
    name: str,
    priority: int,
    weight: float,
    speculative: str | None,
    online_training: bool,
    batch_threshold: int,
    initial_drafter: str | Path | None = None,
) -> job_pb2.CreateJobRequest:
    spec = common_pb2.SpeculativeConfig(
        mode=_speculative_mode(speculative),
        batch_threshold=batch_threshold,
        online_training=online_training,
        initial_drafter_path=str(initial_drafter) if initial_drafter else "",
    )
    return job_pb2.CreateJobRequest(
        job_id=job_id,
        name=name,
        model_path=str(model_path),
        priority=priority,
        weight=weight,
        speculative=spec,
    )


def _update_policy_request(job_id: str, checkpoint_dir: str | Path, note: str):
    return policy_pb2.UpdatePolicyRequest(
        job_id=job_id, checkpoint=policy_pb2.CheckpointSource(path=str(checkpoint_dir)), note=note
    )


class _JobBound:
    """The job a client talks about (given at construction or set by create_job) and the
    endpoints it talks to (one, a list in round-robin, or a gRPC resolver target)."""

    job_id: str | None
    targets: list[str]
    retries: int
    backoff: Backoff
    _rotation: Rotation

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

    def _failover(self, what: str) -> Failover:
        return Failover(self.retries, self.backoff, what)


def _in_order(samples: Iterable[RolloutSample]) -> list[RolloutSample]:
    """(prompt, sample) order, one per sample: a complete sample replaces the partial one a
    drained endpoint delivered before the stream moved on."""
    by_key: dict[tuple[int, int], RolloutSample] = {}
    for s in samples:
        key = (s.prompt_index, s.sample_index)
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


# ---- synchronous ---------------------------------------------------------------------------


class RolloutClient(_JobBound):
    """Synchronous rollout client for trainers.

        client = RolloutClient("127.0.0.1:50051")
        client.create_job("models/tiny-policy", job_id="grpo-1")
        samples = client.generate(prompts, n=8, temperature=1.0, max_new_tokens=512)
        version = client.update_policy("ckpt/step-1")

    Failures raise the typed errors of `clients.errors` (InvalidArgumentError naming the
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
    naming each endpoint's last error. Failovers are logged (logger `clients.failover`).
    Keepalive pings every `keepalive` seconds (None: off) break a stream whose daemon
    vanished without closing the connection, so that it fails over too.
    """

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
        self._bind(target, retries, backoff)
        # One channel per endpoint, with the operator client's auth and error mapping.
        self._raws = [
            TltClient(
                t,
                token,
                tls_ca,
                tls=tls,
                tls_cert=tls_cert,
                tls_key=tls_key,
                timeout=timeout,
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

    def _unary(self, what: str, call: Any) -> Any:
        """`call(raw)` on the next endpoint; on UNAVAILABLE on the one after, with backoff."""
        failover = self._failover(what)
        index = self._rotation.start(time.monotonic())
        while True:
            self._current = index
            raw = self._raws[index]
            try:
                return call(raw)
            except UnavailableError as err:
                time.sleep(failover.next_delay(raw.target, err))
                index = self._rotation.after(index, time.monotonic())

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
    ) -> JobInfo:
        """Create (idempotently, when job_id is given) a job; this client then uses it.

        `initial_drafter`: an offline-fitted EAGLE drafter directory (as
        `EagleDrafter.save_pretrained` / scripts/fit_drafter.py write) the job starts from as
        its drafter version 1; needs speculative "auto" (a learned drafter)."""
        req = _create_job_request(
            model_path,
            job_id,
            name,
            priority,
            weight,
            speculative,
            online_training,
            batch_threshold,
            initial_drafter,
        )
        pb = self._unary("CreateJob", lambda raw: raw.call(raw.jobs.CreateJob, req))
        info = _job_from_pb(pb)
        self.job_id = info.job_id
        return info

    def job(self, job_id: str | None = None) -> JobInfo:
        req = job_pb2.GetJobRequest(job_id=self._job(job_id))
        return _job_from_pb(self._unary("GetJob", lambda raw: raw.call(raw.jobs.GetJob, req)))

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
        **sampling_kwargs: Any,
    ) -> Iterator[RolloutSample]:
        """Yield samples the moment they finish (finish order). Arguments as for generate().
        Arguments are checked at once; the rollout starts at the first next().

        `return_partial`: when a node running a sample is drained and hands it to another
        node, also yield its tokens so far (finish_reason ABORTED, partial=True) before the
        complete sample, which has the same (prompt_index, sample_index) and replaces it.
        Without it each sample is yielded once."""
        params = _sampling(n, sampling, sampling_kwargs)
        rid = request_id or _new_request_id()
        req = _generate_request(
            self._job(job_id), prompts, params, rid, speculative, return_partial
        )
        self.last_request_id = rid
        return self._samples(req, timeout)

    def _samples(
        self, req: rollout_pb2.GenerateRequest, timeout: float | None
    ) -> Iterator[RolloutSample]:
        rid = req.request_id
        deadline = None if timeout is None else time.monotonic() + timeout
        failover = self._failover(f"Generate request {rid}")
        delivered = Delivered()
        index = self._rotation.start(time.monotonic())
        raw = self._raws[index]
        given_up = True  # until the stream ends: break, close(), garbage collection, Ctrl-C
        try:
            while True:
                self._current = index
                raw = self._raws[index]
                call = raw.rollouts.Generate(
                    req, metadata=raw._metadata, timeout=_remaining(deadline, rid)
                )
                try:
                    for resp in call:
                        sample = _sample_from_pb(resp.sample)
                        if delivered.admit(sample):
                            failover.progress()
                            yield sample
                    given_up = False
                    return
                except grpc.RpcError as exc:
                    err = from_rpc_error(exc)
                    if exc.code() not in RETRYABLE:
                        given_up = exc.code() in _GIVEN_UP
                        raise err from None
                    given_up = False  # unreachable: nothing to cancel there
                    delay = failover.next_delay(raw.target, err, len(delivered))
                    given_up = True
                    time.sleep(min(delay, _remaining(deadline, rid) or delay))
                    index = self._rotation.after(index, time.monotonic())
                finally:
                    call.cancel()
        finally:
            if given_up:
                # Closing the stream only detaches (the daemon keeps the work for a retry):
                # a caller that stops reading must not leave work running.
                self._cancel_quietly(raw, rid)

    def _cancel_quietly(self, raw: TltClient, request_id: str) -> None:
        # NOT_FOUND: the daemon may still be storing the request (its admission completes
        # even when the caller has left), so the cancel is retried until it lands.
        deadline = time.monotonic() + _CANCEL_TIMEOUT
        while True:
            try:
                raw.cancel_request(request_id, _ABANDONED, timeout=_CANCEL_TIMEOUT)
                return
            except NotFoundError as exc:
                if time.monotonic() >= deadline:
                    log.debug("could not cancel abandoned request %s: %s", request_id, exc)
                    return
                time.sleep(_CANCEL_RETRY_SECONDS)
            except (TltClientError, ValueError) as exc:  # finished already, or channel closed
                log.debug("could not cancel abandoned request %s: %s", request_id, exc)
                return

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
        **sampling_kwargs: Any,
    ) -> list[RolloutSample]:
        """Roll out `n` samples of every prompt (token ids); all samples, in (prompt, sample)
        order, once the last has finished.

        Sampling: `sampling=SamplingParams(...)` and/or its fields as keywords (temperature,
        top_p, top_k, max_new_tokens, stop_token_ids, seed, logprob_mode "processed" (default)
        or "raw", return_provenance); keywords win. `speculative`:
        "auto" (adaptive SD), "off", or None (the job's mode). `request_id` (default: a fresh
        one, see `last_request_id`) makes a retry attach to the same work. No overall timeout
        unless given: rollouts run long; when it passes, the request is cancelled and
        DeadlineExceededError raised.
        """
        samples = self.stream(
            prompts,
            n,
            sampling=sampling,
            request_id=request_id,
            speculative=speculative,
            job_id=job_id,
            timeout=timeout,
            **sampling_kwargs,
        )
        return _in_order(samples)

    def cancel(self, request_id: str, reason: str = "") -> None:
        self._unary("CancelRequest", lambda raw: raw.cancel_request(request_id, reason))

    def update_policy(
        self, checkpoint_dir: str | Path, *, note: str = "", job_id: str | None = None
    ) -> int:
        """Push new weights (a Hugging Face checkpoint directory the daemon can read); returns
        the new policy version, which samples generated from now on carry.

        Retried on the next endpoint on UNAVAILABLE like every call: a connection lost after
        the daemon recorded the version can record the same checkpoint twice (two versions,
        the same weights)."""
        req = _update_policy_request(self._job(job_id), checkpoint_dir, note)
        pb = self._unary("UpdatePolicy", lambda raw: raw.call(raw.policy.UpdatePolicy, req))
        return int(pb.policy.version)

    def push_policy(self, weights: Any, *, job_id: str | None = None, **kwargs: Any) -> int:
        """Push new weights in-band (a state dict of torch tensors with HF names, or a
        safetensors file or directory): the daemon needs no access to the trainer's disk.
        Resumable, optionally a delta (`base_version=`, `base_weights=`); see
        `TltClient.push_policy` for the keyword arguments. Returns the new policy version."""
        return int(self.raw.push_policy(self._job(job_id), weights, **kwargs).policy.version)


# ---- asyncio -------------------------------------------------------------------------------


class AsyncRolloutClient(_JobBound):
    """The asyncio twin of RolloutClient (grpc.aio); same methods, awaitable:

    async with AsyncRolloutClient(target) as client:
        await client.create_job(model_dir)
        samples = await client.generate(prompts, n=8)
        async for s in client.stream(prompts, n=8): ...

    The client may be built outside a running loop (e.g. in a trainer's __init__): its
    channels are opened on first use, in the loop that uses them. Request ids, cancellation
    of abandoned streams, errors, several endpoints and failover as for RolloutClient.
    """

    last_request_id: str | None = None

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
        self._creds = channel_credentials(tls, tls_ca, tls_cert, tls_key)  # checked now
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

    async def _unary(self, what: str, stub: type, method: str, request: Any) -> Any:
        """`stub(channel).method(request)` on the next endpoint; on UNAVAILABLE on the one
        after, with backoff."""
        failover = self._failover(what)
        index = self._rotation.start(time.monotonic())
        while True:
            try:
                return await self._call(getattr(stub(self._channel(index)), method), request)
            except UnavailableError as err:
                await asyncio.sleep(failover.next_delay(self.targets[index], err))
                index = self._rotation.after(index, time.monotonic())

    async def create_job(
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
    ) -> JobInfo:
        req = _create_job_request(
            model_path,
            job_id,
            name,
            priority,
            weight,
            speculative,
            online_training,
            batch_threshold,
            initial_drafter,
        )
        pb = await self._unary("CreateJob", job_pb2_grpc.JobServiceStub, "CreateJob", req)
        info = _job_from_pb(pb)
        self.job_id = info.job_id
        return info

    async def job(self, job_id: str | None = None) -> JobInfo:
        req = job_pb2.GetJobRequest(job_id=self._job(job_id))
        return _job_from_pb(await self._unary("GetJob", job_pb2_grpc.JobServiceStub, "GetJob", req))

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
        **sampling_kwargs: Any,
    ) -> AsyncIterator[RolloutSample]:
        """An async iterator of samples as they finish (`async for s in client.stream(...)`);
        `return_partial` as for `RolloutClient.stream`."""
        params = _sampling(n, sampling, sampling_kwargs)
        rid = request_id or _new_request_id()
        req = _generate_request(
            self._job(job_id), prompts, params, rid, speculative, return_partial
        )
        self.last_request_id = rid
        return self._samples(req, timeout)

    async def _samples(
        self, req: rollout_pb2.GenerateRequest, timeout: float | None
    ) -> AsyncIterator[RolloutSample]:
        rid = req.request_id
        deadline = None if timeout is None else time.monotonic() + timeout
        failover = self._failover(f"Generate request {rid}")
        delivered = Delivered()
        index = self._rotation.start(time.monotonic())
        given_up = True  # until the stream ends: aclose(), break, task cancelled (wait_for)
        try:
            while True:
                stub = rollout_pb2_grpc.RolloutServiceStub(self._channel(index))
                call = stub.Generate(
                    req, metadata=self._metadata, timeout=_remaining(deadline, rid)
                )
                try:
                    async for resp in call:
                        sample = _sample_from_pb(resp.sample)
                        if delivered.admit(sample):
                            failover.progress()
                            yield sample
                    given_up = False
                    return
                except grpc.RpcError as exc:
                    err = from_rpc_error(exc)
                    if exc.code() not in RETRYABLE:
                        given_up = exc.code() in _GIVEN_UP
                        raise err from None
                    given_up = False  # unreachable: nothing to cancel there
                    delay = failover.next_delay(self.targets[index], err, len(delivered))
                    given_up = True
                    await asyncio.sleep(min(delay, _remaining(deadline, rid) or delay))
                    index = self._rotation.after(index, time.monotonic())
                finally:
                    call.cancel()
        finally:
            if given_up:
                # Closing the stream only detaches (the daemon keeps the work for a retry):
                # a caller that stops reading must not leave work running.
                await self._cancel_quietly(index, rid)

    async def _cancel_quietly(self, index: int, request_id: str) -> None:
        if not self._channels or self._loop is not asyncio.get_running_loop():
            return  # the client was closed first: nothing to cancel with
        req = rollout_pb2.CancelRequestRequest(request_id=request_id, reason=_ABANDONED)
        stub = rollout_pb2_grpc.RolloutServiceStub(self._channels[index])
        deadline = time.monotonic() + _CANCEL_TIMEOUT
        while True:  # NOT_FOUND retried: see RolloutClient._cancel_quietly
            try:
                await self._call(stub.CancelRequest, req, timeout=_CANCEL_TIMEOUT)
                return
            except NotFoundError as exc:
                if time.monotonic() >= deadline:
                    log.debug("could not cancel abandoned request %s: %s", request_id, exc)
                    return
                await asyncio.sleep(_CANCEL_RETRY_SECONDS)
            except (TltClientError, grpc.aio.UsageError) as exc:  # finished already, or closing
                log.debug("could not cancel abandoned request %s: %s", request_id, exc)
                return

    async def generate(
        self,
        prompts: Iterable[Sequence[int]],
        n: int | None = None,
        *,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        speculative: str | None = None,
        job_id: str | None = None,
        timeout: float | None = None,
        **sampling_kwargs: Any,
    ) -> list[RolloutSample]:
        """As RolloutClient.generate."""
        samples = [
            s
            async for s in self.stream(
                prompts,
                n,
                sampling=sampling,
                request_id=request_id,
                speculative=speculative,
                job_id=job_id,
                timeout=timeout,
                **sampling_kwargs,
            )
        ]
        return _in_order(samples)

    async def cancel(self, request_id: str, reason: str = "") -> None:
        req = rollout_pb2.CancelRequestRequest(request_id=request_id, reason=reason)
        await self._unary(
            "CancelRequest", rollout_pb2_grpc.RolloutServiceStub, "CancelRequest", req
        )

    async def update_policy(
        self, checkpoint_dir: str | Path, *, note: str = "", job_id: str | None = None
    ) -> int:
        """As RolloutClient.update_policy (failover included)."""
        req = _update_policy_request(self._job(job_id), checkpoint_dir, note)
        pb = await self._unary(
            "UpdatePolicy", policy_pb2_grpc.PolicyServiceStub, "UpdatePolicy", req
        )
        return int(pb.policy.version)
