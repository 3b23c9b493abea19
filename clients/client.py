"""TltClient: a synchronous wrapper over the tltd stubs with bearer auth and typed errors."""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tltd.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    job_pb2,
    job_pb2_grpc,
    policy_pb2,
    policy_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
)
from tltd_clients.endpoints import KEEPALIVE, channel_options
from tltd_clients.errors import NotFoundError, from_rpc_error
from tltd_clients.push import (
    DEFAULT_CHUNK_BYTES,
    ProgressCounter,
    PushProgress,
    Weights,
    header_pb,
    new_update_id,
    open_push,
    push_messages,
)

DEFAULT_TARGET = "127.0.0.1:50051"
log = logging.getLogger(__name__)


# A push stream that failed with one of these is resumed (what arrived verified stays).
_RESUMABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    }
)


class ClientTimeout(enum.Enum):
    """The type of CLIENT_TIMEOUT (a sentinel: None already means "no deadline")."""

    TOKEN = "client timeout"


# `timeout=CLIENT_TIMEOUT` (the default of the methods that take one): the client's own
# `timeout`. A number is a deadline in seconds; None is no deadline (not "the default").
CLIENT_TIMEOUT = ClientTimeout.TOKEN


def channel_credentials(
    tls: bool, tls_ca: str | None, tls_cert: str | None, tls_key: str | None
) -> grpc.ChannelCredentials | None:
    """TLS credentials, or None for a plaintext channel. A client certificate and its key go
    together: gRPC's C core aborts the whole process (SIGABRT) when given only one."""
    if bool(tls_cert) != bool(tls_key):
        given, missing = ("tls_cert", "tls_key") if tls_cert else ("tls_key", "tls_cert")
        raise ValueError(f"{given} was given without {missing}: a client certificate needs its key")
    if not (tls or tls_ca or tls_cert):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=Path(tls_ca).read_bytes() if tls_ca else None,
        private_key=Path(tls_key).read_bytes() if tls_key else None,
        certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None,
    )


class TltClient:
    """One channel to one daemon. Methods return the proto messages of tltd.v1 and raise
    `tltd_clients.errors.TltClientError` subclasses (NotFoundError, InvalidArgumentError, ...).

    TLS is on when `tls_ca` (a PEM file to trust) or `tls=True` (system roots) is given;
    `tls_cert`/`tls_key` add a client certificate for daemons that require mTLS (both or
    neither: ValueError otherwise).

    `timeout` is each unary call's deadline in seconds (None: no deadline). The long calls,
    `generate` and `export_drafter`, have none unless given one.

    A resolver target (`dns:///tltd.example:50051`, `ipv4:10.0.0.1:50051,10.0.0.2:50051`)
    is one channel over every address it resolves to, with gRPC's `round_robin` policy; this
    class does not retry (RolloutClient fails over). `keepalive`: seconds between pings that
    detect a silently dead connection (None: off).
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        token: str | None = None,
        tls_ca: str | None = None,
        *,
        tls: bool = False,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        timeout: float | None = 30.0,
        keepalive: float | None = KEEPALIVE,
    ) -> None:
        options = channel_options(target, keepalive)
        creds = channel_credentials(tls, tls_ca, tls_cert, tls_key)
        if creds is not None:
            self.channel = grpc.secure_channel(target, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        self.target = target
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.rollouts = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        self.policy = policy_pb2_grpc.PolicyServiceStub(self.channel)
        # PushPolicy with messages serialized by `tltd_clients.push` (bytes sent as they are).
        self._push_serialized = self.channel.stream_unary(
            "/tltd.v1.PolicyService/PushPolicy",
            request_serializer=bytes,
            response_deserializer=policy_pb2.PushPolicyResponse.FromString,
        )
        self.drafters = drafter_pb2_grpc.DrafterServiceStub(self.channel)
        self.jobs = job_pb2_grpc.JobServiceStub(self.channel)
        self.admin = admin_pb2_grpc.AdminServiceStub(self.channel)
        self.sessions = session_pb2_grpc.SessionServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    # -- plumbing ------------------------------------------------------------------------------

    def call(self, method, request, timeout: float | None | ClientTimeout = CLIENT_TIMEOUT) -> Any:
        """Call a unary stub method with auth metadata; map failures to typed errors. `timeout`:
        seconds, None for no deadline, or CLIENT_TIMEOUT for the client's."""
        if timeout is CLIENT_TIMEOUT:
            timeout = self.timeout
        try:
            return method(request, metadata=self._metadata, timeout=timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> TltClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- jobs ----------------------------------------------------------------------------------

    def create_job(
        self,
        model_path: str,
        *,
        job_id: str = "",
        name: str = "",
        backend: int = common_pb2.BACKEND_UNSPECIFIED,
        priority: int = 0,
        weight: float = 0.0,
        speculative: common_pb2.SpeculativeConfig | None = None,
        initial_drafter: str | os.PathLike[str] = "",
        policy_switch: int = job_pb2.POLICY_SWITCH_UNSPECIFIED,
        max_staleness: int | None = None,
    ) -> job_pb2.Job:
        """`initial_drafter`: an offline-fitted EAGLE drafter directory the job starts from
        (sets `speculative.initial_drafter_path`). `policy_switch`
        POLICY_SWITCH_NEXT_STEP: running requests move to a new policy version between decode
        steps (Sample.policy_spans says which tokens came from which version).
        `max_staleness`: Job.max_staleness (None: no bound)."""
        if initial_drafter:
            spec = common_pb2.SpeculativeConfig()
            if speculative is not None:
                spec.CopyFrom(speculative)
            spec.initial_drafter_path = os.fspath(initial_drafter)
            speculative = spec
        req = job_pb2.CreateJobRequest(
            job_id=job_id,
            name=name,
            model_path=model_path,
            backend=backend,
            priority=priority,
            weight=weight,
            speculative=speculative,
            policy_switch=policy_switch,
            max_staleness=max_staleness,
        )
        return self.call(self.jobs.CreateJob, req)

    def get_job(self, job_id: str) -> job_pb2.Job:
        return self.call(self.jobs.GetJob, job_pb2.GetJobRequest(job_id=job_id))

    def list_jobs(self, statuses: Iterable[int] = (), limit: int = 0) -> list[job_pb2.Job]:
        req = job_pb2.ListJobsRequest(statuses=list(statuses), limit=limit)
        return list(self.call(self.jobs.ListJobs, req).jobs)

    def cancel_job(self, job_id: str, reason: str = "") -> job_pb2.Job:
        return self.call(
            self.jobs.CancelJob, job_pb2.CancelJobRequest(job_id=job_id, reason=reason)
        )

    # -- rollouts ------------------------------------------------------------------------------

    def generate(
        self,
        job_id: str,
        prompts: Iterable[Iterable[int]],
        *,
        sampling: rollout_pb2.SamplingParams | None = None,
        request_id: str = "",
        speculative: int = common_pb2.SPECULATIVE_MODE_UNSPECIFIED,
        timeout: float | None = None,
        return_partial: bool = False,
        bound: rollout_pb2.StepBound | None = None,
    ) -> Iterator[rollout_pb2.Sample]:
        """Stream samples as they finish (no overall timeout unless given: rollouts run long);
        `return_partial` and `bound` as in GenerateRequest."""
        req = rollout_pb2.GenerateRequest(
            job_id=job_id,
            request_id=request_id,
            prompts=[rollout_pb2.Prompt(token_ids=list(p)) for p in prompts],
            sampling=sampling,
            speculative=speculative,
            return_partial=return_partial,
            batch_samples=True,
            bound=bound,
        )
        try:
            for resp in self.rollouts.Generate(req, metadata=self._metadata, timeout=timeout):
                yield from resp.samples if len(resp.samples) else (resp.sample,)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def get_request(
        self, request_id: str, include_samples: bool = False
    ) -> rollout_pb2.GetRequestResponse:
        req = rollout_pb2.GetRequestRequest(request_id=request_id, include_samples=include_samples)
        return self.call(self.rollouts.GetRequest, req)

    def cancel_request(
        self,
        request_id: str,
        reason: str = "",
        timeout: float | None | ClientTimeout = CLIENT_TIMEOUT,
    ) -> rollout_pb2.RolloutRequest:
        req = rollout_pb2.CancelRequestRequest(request_id=request_id, reason=reason)
        return self.call(self.rollouts.CancelRequest, req, timeout=timeout).request

    # -- sessions ------------------------------------------------------------------------------

    def open_session(
        self, job_id: str, prompt_token_ids: Iterable[int], session_id: str = ""
    ) -> session_pb2.Session:
        req = session_pb2.OpenSessionRequest(
            job_id=job_id, session_id=session_id, prompt_token_ids=list(prompt_token_ids)
        )
        return self.call(self.sessions.OpenSession, req)

    def open_session_group(
        self, job_id: str, prompt_token_ids: Iterable[int], n: int, group_id: str = ""
    ) -> session_pb2.SessionGroup:
        """Open n sessions of one prompt, "<group_id>.0" .. "<group_id>.<n-1>" (GRPO over
        agents): their first turns share the prompt's prefill on a worker. Give each turn its
        own seed, or none (then it derives from the session id), for their answers to differ."""
        req = session_pb2.OpenSessionGroupRequest(
            job_id=job_id, group_id=group_id, prompt_token_ids=list(prompt_token_ids), n=n
        )
        return self.call(self.sessions.OpenSessionGroup, req)

    def turn(
        self,
        session_id: str,
        turn_index: int,
        input_token_ids: Iterable[int] = (),
        *,
        sampling: rollout_pb2.SamplingParams | None = None,
        timeout: float | None = None,
    ) -> session_pb2.TurnResponse:
        """Run the session's turn `turn_index` (its done turns so far) after the new tokens
        `input_token_ids`; a retry with the same arguments attaches to the same turn. No
        deadline unless given one: a turn runs as long as its rollout."""
        req = session_pb2.TurnRequest(
            session_id=session_id,
            turn_index=turn_index,
            input_token_ids=list(input_token_ids),
            sampling=sampling,
        )
        return self.call(self.sessions.Turn, req, timeout=timeout)

    def get_session(self, session_id: str) -> session_pb2.Session:
        req = session_pb2.GetSessionRequest(session_id=session_id)
        return self.call(self.sessions.GetSession, req)

    def close_session(self, session_id: str) -> session_pb2.Session:
        req = session_pb2.CloseSessionRequest(session_id=session_id)
        return self.call(self.sessions.CloseSession, req)

    def list_sessions(
        self, job_id: str = "", statuses: Iterable[int] = (), limit: int = 0
    ) -> list[session_pb2.SessionSummary]:
        req = session_pb2.ListSessionsRequest(job_id=job_id, statuses=list(statuses), limit=limit)
        return list(self.call(self.sessions.ListSessions, req).sessions)

    # -- policy --------------------------------------------------------------------------------

    def update_policy(
        self, job_id: str, checkpoint_path: str, note: str = ""
    ) -> policy_pb2.PolicyVersion:
        req = policy_pb2.UpdatePolicyRequest(
            job_id=job_id, checkpoint=policy_pb2.CheckpointSource(path=checkpoint_path), note=note
        )
        return self.call(self.policy.UpdatePolicy, req).policy

    def get_policy(self, job_id: str, version: int | None = None) -> policy_pb2.PolicyVersion:
        req = policy_pb2.GetPolicyRequest(job_id=job_id, version=version)
        return self.call(self.policy.GetPolicy, req)

    def get_push(self, job_id: str, update_id: str) -> policy_pb2.PushStatus:
        req = policy_pb2.GetPushRequest(job_id=job_id, update_id=update_id)
        return self.call(self.policy.GetPush, req)

    def push_policy(
        self,
        job_id: str,
        weights: Mapping[str, Any] | str | Path,
        *,
        update_id: str | None = None,
        note: str = "",
        base_version: int | None = None,
        base_weights: Mapping[str, Any] | str | Path | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        progress: Callable[[PushProgress], None] | None = None,
        retries: int = 3,
        timeout: float | None = None,
    ) -> policy_pb2.PushPolicyResponse:
        """Send new policy weights in-band (a state dict of torch tensors with HF names, or a
        safetensors file or directory): the daemon needs no access to the trainer's disk.

        A stream that breaks (connection lost, daemon busy with another stream of the same
        push) is resumed up to `retries` times: the daemon says what it holds and only the
        rest is sent; call again with the same `update_id` to resume later yourself. With
        `base_version` and `base_weights` (the weights of that version, as the daemon holds
        them) chunks go as zstd-compressed XOR deltas where that is smaller. Returns the
        response whose `policy` is the new version."""
        update_id = update_id or new_update_id()
        new, base = open_push(weights, base_version, base_weights)
        header = header_pb(job_id, update_id, new, note, base_version)
        sent = ProgressCounter(update_id, 0, sum(len(new.data(n)) for n in new.specs), progress)
        try:
            for attempt in range(retries + 1):
                have = self._push_progress(job_id, update_id)
                if isinstance(have, policy_pb2.PushPolicyResponse):
                    return have  # a committed push whose answer was lost
                sent.done = sum(have.values())  # what the daemon holds; the wire bytes add up
                messages = push_messages(
                    header,
                    new,
                    have,
                    base=base,
                    chunk_bytes=chunk_bytes,
                    on_chunk=sent,
                    serialized=True,
                )
                try:
                    return self._push_serialized(messages, metadata=self._metadata, timeout=timeout)
                except grpc.RpcError as exc:
                    if attempt < retries and exc.code() in _RESUMABLE:
                        time.sleep(min(2.0, 0.1 * 2**attempt))
                        continue
                    raise from_rpc_error(exc) from None
            raise AssertionError("unreachable")
        finally:
            new.close()
            if base is not None:
                base.close()

    def broadcast_policy(
        self,
        job_id: str,
        state_dict: Mapping[str, Any],
        *,
        update_id: str | None = None,
        note: str = "",
        timeout: float = 300.0,
        fallback: bool = True,
        backend: str = "gloo",
        device: str = "cuda",
    ) -> policy_pb2.PushPolicyResponse:
        """Send new weights (torch tensors with HF names) by a torch.distributed broadcast:
        the daemon opens a group (itself and, with gloo, the job's workers), this process
        joins it as the source (in a process group object of its own: a default group the
        trainer trains in is untouched), every tensor is broadcast, then the push is
        committed. Returns the response whose `policy` is the new version.

        `backend="nccl"`: the daemon still receives over gloo (it is a CPU process); the job's
        workers on CUDA devices receive in an NCCL group of their own, which this process joins
        on `device` too, and every tensor goes to both groups.

        A broadcast is one collective: a rank that dies or never joins fails it, after
        `timeout` seconds at the most. Then, with `fallback`, the weights go by `push_policy`
        (gRPC) under a new update id, and the daemon drops the broadcast's unfinished push
        once idle; without it the error is raised."""
        update_id = update_id or new_update_id()
        weights = Weights(state_dict)
        header = header_pb(job_id, update_id, weights, note, None)
        weights.close()
        req = policy_pb2.OpenBroadcastRequest(
            header=header, backend=backend, timeout_seconds=timeout
        )
        group = self.call(self.policy.OpenBroadcast, req)
        try:
            self._broadcast(group, header, state_dict, timeout, device)
        except (RuntimeError, TimeoutError) as exc:  # torch.distributed's errors included
            if not fallback:
                raise
            log.warning("policy broadcast %s failed (%s): pushing by gRPC instead", update_id, exc)
            return self.push_policy(job_id, state_dict, note=note)
        return self.push_policy(job_id, state_dict, update_id=update_id, retries=30)

    def _broadcast(
        self, group, header, state_dict: Mapping[str, Any], timeout: float, device: str
    ) -> None:
        """Join `group` (and its workers' group) as the source, broadcast every tensor of
        `header`, and wait until the daemon holds them all."""
        import datetime

        import torch.distributed as dist

        from tltd.contract.broadcast import process_group  # the daemon's and workers' groups

        wait = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore(group.address, group.port, group.world_size, False, timeout=wait)
        pg = process_group("gloo", store, group.prefix, group.rank, group.world_size, wait)
        workers = None
        if group.HasField("workers"):
            w = group.workers
            workers = process_group(w.backend, store, w.prefix, 0, w.world_size, wait)
        opts = dist.BroadcastOptions()
        opts.rootRank = group.rank
        for spec in header.tensors:
            t = state_dict[spec.name].detach()
            pg.broadcast([t.to("cpu").contiguous()], opts).wait()
            if workers is not None:
                on = device if group.workers.backend == "nccl" else "cpu"
                workers.broadcast([t.to(on).contiguous()], opts).wait()
        if workers is not None and group.workers.backend == "nccl":
            import torch

            torch.cuda.synchronize(device)  # NCCL's wait() does not block the host
        del pg, workers, store
        # The daemon may still be writing the last tensor: commit once it holds them all.
        deadline = time.monotonic() + timeout
        job_id, update_id = header.job_id, header.update_id
        while (status := self.get_push(job_id, update_id)).bytes_received < status.bytes_total:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the daemon holds {status.bytes_received} of {status.bytes_total} bytes "
                    f"of broadcast {update_id} after {timeout} s (see its log)"
                )
            time.sleep(0.02)

    def _push_progress(
        self, job_id: str, update_id: str
    ) -> dict[str, int] | policy_pb2.PushPolicyResponse:
        """Bytes the daemon holds per tensor of a push (none yet: {}), or, for a push already
        recorded, a response naming its version."""
        try:
            status = self.get_push(job_id, update_id)
        except NotFoundError:
            return {}
        if status.version:
            policy = self.get_policy(job_id, status.version)
            return policy_pb2.PushPolicyResponse(status=status, policy=policy)
        return {t.name: t.received for t in status.tensors}

    # -- drafters ------------------------------------------------------------------------------

    def list_drafters(self, job_id: str) -> drafter_pb2.ListDraftersResponse:
        return self.call(self.drafters.ListDrafters, drafter_pb2.ListDraftersRequest(job_id=job_id))

    def get_drafter(self, job_id: str, version: int) -> drafter_pb2.DrafterVersion:
        req = drafter_pb2.GetDrafterRequest(job_id=job_id, version=version)
        return self.call(self.drafters.GetDrafter, req)

    def pin_drafter(self, job_id: str, version: int) -> drafter_pb2.PinDrafterResponse:
        req = drafter_pb2.PinDrafterRequest(job_id=job_id, version=version)
        return self.call(self.drafters.PinDrafter, req)

    def export_drafter(
        self,
        job_id: str,
        version: int,
        output_dir: str,
        fmt: str = "",
        timeout: float | None = None,
    ) -> drafter_pb2.ExportDrafterResponse:
        """No deadline unless given (as `generate`): the export copies the target policy's
        embeddings, about 1 GB for a 7B model."""
        req = drafter_pb2.ExportDrafterRequest(
            job_id=job_id, version=version, output_dir=output_dir, format=fmt
        )
        return self.call(self.drafters.ExportDrafter, req, timeout=timeout)

    # -- admin ---------------------------------------------------------------------------------

    def list_devices(self) -> list[admin_pb2.Device]:
        return list(self.call(self.admin.ListDevices, admin_pb2.ListDevicesRequest()).devices)

    def list_workers(self, device_id: str = "") -> list[admin_pb2.Worker]:
        req = admin_pb2.ListWorkersRequest(device_id=device_id)
        return list(self.call(self.admin.ListWorkers, req).workers)

    def cordon(self, device_id: str, reason: str = "", node_id: str = "") -> admin_pb2.Device:
        """Cordon a device, or with `node_id` (and no device) every device of that node."""
        req = admin_pb2.CordonRequest(device_id=device_id, reason=reason, node_id=node_id)
        return self.call(self.admin.Cordon, req)

    def uncordon(self, device_id: str, node_id: str = "") -> admin_pb2.Device:
        req = admin_pb2.UncordonRequest(device_id=device_id, node_id=node_id)
        return self.call(self.admin.Uncordon, req)

    def drain(
        self, device_id: str = "", node: bool = False, grace_seconds: int = 0, node_id: str = ""
    ) -> list[admin_pb2.Device]:
        """Drain a device, or with node=True this node, or with `node_id` too that node."""
        req = admin_pb2.DrainRequest(
            device_id=device_id, node=node, grace_seconds=grace_seconds, node_id=node_id
        )
        return list(self.call(self.admin.Drain, req).devices)

    def list_nodes(self) -> list[admin_pb2.Node]:
        return list(self.call(self.admin.ListNodes, admin_pb2.ListNodesRequest()).nodes)

    def stats(self) -> admin_pb2.Stats:
        return self.call(self.admin.GetStats, admin_pb2.GetStatsRequest())

    def health(self, service: str = "") -> str:
        """SERVING / NOT_SERVING for the server ("") or one service, e.g. tltd.v1.RolloutService."""
        resp = self.call(self._health.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
