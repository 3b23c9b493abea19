"""Bearer-token auth and roles, health and reflection, through a real server."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from tests.api.support import ADMIN_TOKEN, TRAINER_TOKEN, fails, sampling
from tltd.api.interceptors import AuthInterceptor, required_role
from tltd.v1 import admin_pb2
from tltd_clients.errors import PermissionDeniedError, UnauthenticatedError

C = grpc.StatusCode

TLTD_SERVICES = {
    "tltd.v1.RolloutService",
    "tltd.v1.PolicyService",
    "tltd.v1.DrafterService",
    "tltd.v1.JobService",
    "tltd.v1.AdminService",
    "tltd.v1.SessionService",
}


def test_role_table():
    assert required_role("/grpc.health.v1.Health/Check") == "public"
    assert required_role("/tltd.v1.RolloutService/Generate") == "trainer"
    assert required_role("/tltd.v1.PolicyService/UpdatePolicy") == "trainer"
    assert required_role("/tltd.v1.JobService/CreateJob") == "trainer"
    assert required_role("/tltd.v1.JobService/CancelJob") == "trainer"
    assert required_role("/tltd.v1.AdminService/GetStats") == "trainer"
    for rpc in ("OpenSession", "Turn", "GetSession", "CloseSession"):
        assert required_role(f"/tltd.v1.SessionService/{rpc}") == "trainer"
    assert (
        required_role("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo") == "trainer"
    )
    for admin_only in (
        "AdminService/Cordon",
        "AdminService/Uncordon",
        "AdminService/Drain",
        "DrafterService/PinDrafter",
        "DrafterService/ExportDrafter",
        "FutureService/Anything",
    ):
        assert required_role(f"/tltd.v1.{admin_only}") == "admin"


def test_token_lookup():
    auth = AuthInterceptor({"a": "admin", "t": "trainer"})
    assert auth.role_for("a") == "admin" and auth.role_for("t") == "trainer"
    assert auth.role_for("x") is None and auth.role_for(None) is None and auth.role_for("") is None


def test_missing_or_unknown_token_is_unauthenticated(auth_daemon):
    for token in (None, "wrong-token"):
        with auth_daemon.client(token) as c:
            with fails(C.UNAUTHENTICATED, "bearer token"):
                c.list_jobs()
            with fails(C.UNAUTHENTICATED):  # server-streaming is guarded too
                list(c.generate("job", [[1]], sampling=sampling()))
            with pytest.raises(UnauthenticatedError):
                c.cordon("cpu:0")


def test_malformed_authorization_header(auth_daemon):
    with auth_daemon.client() as c:
        md = (("authorization", f"Basic {ADMIN_TOKEN}"),)
        with pytest.raises(grpc.RpcError) as info:
            c.admin.GetStats(admin_pb2.GetStatsRequest(), metadata=md)
        assert info.value.code() == C.UNAUTHENTICATED


def test_trainer_role(auth_daemon, model_dir):
    with auth_daemon.client(TRAINER_TOKEN) as c:
        job = c.create_job(str(model_dir), job_id="job")  # trainers create their jobs
        assert c.get_job("job") == job and c.stats().jobs_active == 1
        assert len(c.list_devices()) == 2 and c.list_drafters("job").active_version == 0
        # The streaming RPC is allowed: it reaches validation.
        with fails(C.INVALID_ARGUMENT, "sampling.max_new_tokens"):
            list(c.generate("job", [[1]]))
        for call, method in (
            (lambda: c.cordon("cpu:0"), "Cordon"),
            (lambda: c.uncordon("cpu:0"), "Uncordon"),
            (lambda: c.drain(node=True), "Drain"),
            (lambda: c.pin_drafter("job", 0), "PinDrafter"),
            (lambda: c.export_drafter("job", 1, "/tmp/x"), "ExportDrafter"),
        ):
            with fails(C.PERMISSION_DENIED, "/tltd.v1.", method, "admin"):
                call()
        with pytest.raises(PermissionDeniedError):
            c.cordon("cpu:1")
        assert c.cancel_job("job").job_id == "job"
    assert not auth_daemon.store.devices.get("cpu:0").cordoned  # the denied call did nothing
    assert not auth_daemon.node.draining


def test_admin_role(auth_daemon, model_dir):
    with auth_daemon.client(ADMIN_TOKEN) as c:
        c.create_job(str(model_dir), job_id="job")
        assert c.cordon("cpu:0").cordoned
        assert c.pin_drafter("job", 0).active_version == 0
        with fails(C.INVALID_ARGUMENT, "sampling.max_new_tokens"):
            list(c.generate("job", [[1]]))


def test_health_answers_without_token(auth_daemon):
    with auth_daemon.client() as c:
        assert c.health() == "SERVING"
        for name in TLTD_SERVICES:
            assert c.health(name) == "SERVING"
        with fails(C.NOT_FOUND):
            c.health("no.such.Service")


def test_health_goes_not_serving_on_shutdown(auth_daemon):
    import asyncio

    channel = grpc.insecure_channel(auth_daemon.target)
    stub = health_pb2_grpc.HealthStub(channel)
    watch = stub.Watch(health_pb2.HealthCheckRequest(service="tltd.v1.RolloutService"))
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    # Graceful shutdown with a grace period: NOT_SERVING reaches watchers before the socket
    # closes.
    fut = asyncio.run_coroutine_threadsafe(auth_daemon.api.stop(2.0), auth_daemon.loop)
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    watch.cancel()  # the stream is the one RPC in flight; the grace need not run out
    fut.result(timeout=30)
    channel.close()


def test_reflection_lists_services(auth_daemon):
    md = (("authorization", f"Bearer {TRAINER_TOKEN}"),)

    class AuthedChannel:
        """Reflection's client has no metadata hook; add the token on the one stream it opens."""

        def __init__(self, channel):
            self._channel = channel

        def stream_stream(self, *a, **kw):
            call = self._channel.stream_stream(*a, **kw)
            return lambda requests, **kw2: call(requests, metadata=md, **kw2)

    with grpc.insecure_channel(auth_daemon.target) as channel:
        db = ProtoReflectionDescriptorDatabase(AuthedChannel(channel))
        services = set(db.get_services())
        assert TLTD_SERVICES <= services
        assert "grpc.health.v1.Health" in services
        fd = db.FindFileContainingSymbol("tltd.v1.RolloutService")
        assert fd.name == "tltd/v1/rollout.proto"
        # Without a token reflection is refused like any non-public RPC.
        with pytest.raises(grpc.RpcError) as info:
            set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert info.value.code() == C.UNAUTHENTICATED


def test_reflection_v1_is_served_too(auth_daemon):
    """grpcurl and newer clients ask `grpc.reflection.v1`; the wire format is v1alpha's."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2 as r

    md = (("authorization", f"Bearer {TRAINER_TOKEN}"),)
    with grpc.insecure_channel(auth_daemon.target) as channel:
        info = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=r.ServerReflectionRequest.SerializeToString,
            response_deserializer=r.ServerReflectionResponse.FromString,
        )
        asks = [
            r.ServerReflectionRequest(list_services=""),
            r.ServerReflectionRequest(file_containing_symbol="tltd.v1.RolloutService"),
            r.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection"),
        ]
        listed, rollout, itself = list(info(iter(asks), metadata=md, timeout=30))
        services = {s.name for s in listed.list_services_response.service}
        assert TLTD_SERVICES <= services
        assert {"grpc.reflection.v1.ServerReflection", "grpc.health.v1.Health"} <= services
        names = []
        for resp in (rollout, itself):
            fd = descriptor_pb2.FileDescriptorProto.FromString(
                resp.file_descriptor_response.file_descriptor_proto[0]
            )
            names.append((fd.name, fd.package))
        assert names == [
            ("tltd/v1/rollout.proto", "tltd.v1"),
            ("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"),
        ]
        with pytest.raises(grpc.RpcError) as err:  # as v1alpha: not without a token
            list(info(iter(asks[:1]), timeout=30))
        assert err.value.code() == C.UNAUTHENTICATED


def test_undecodable_bytes_without_a_token_are_unauthenticated(auth_daemon):
    """Auth answers first: a caller without a token learns nothing about its request."""
    with grpc.insecure_channel(auth_daemon.target) as channel:
        get_job = channel.unary_unary("/tltd.v1.JobService/GetJob")  # raw bytes
        bad = bytes.fromhex("0a02fffe")  # job_id: invalid UTF-8
        with pytest.raises(grpc.RpcError) as info:
            get_job(bad, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            get_job(bad, timeout=10, metadata=[("authorization", f"Bearer {TRAINER_TOKEN}")])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
