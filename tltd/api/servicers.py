"""Thin gRPC servicers: proto -> domain (convert), call a service, domain -> proto. No try/except:
errors are mapped once, by the interceptor."""

from __future__ import annotations

from asyncio import to_thread

from tltd.api import convert as c
from tltd.domain import TensorChunk
from tltd.services import Services
from tltd.v1 import (
    admin_pb2,
    admin_pb2_grpc,
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

# Services are synchronous (the store is): `to_thread` keeps their I/O off the event loop.


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, services: Services) -> None:
        self.svc = services.rollouts

    async def Generate(self, request, context):
        req, speculative = c.rollout_from_pb(request)
        batches = self.svc.generate_batches(req, speculative, request.return_partial)
        async for samples in batches:
            if request.batch_samples:
                for resp in c.generate_batch_responses(samples):
                    yield resp
            else:
                for sample in samples:
                    yield c.generate_response(sample)

    async def GetRequest(self, request, context):
        req, samples = await to_thread(self.svc.get, request.request_id, request.include_samples)
        return rollout_pb2.GetRequestResponse(
            request=c.rollout_to_pb(req), samples=[c.sample_to_pb(s) for s in samples]
        )

    async def CancelRequest(self, request, context):
        req = await to_thread(self.svc.cancel, request.request_id, request.reason)
        return rollout_pb2.CancelRequestResponse(request=c.rollout_to_pb(req))


class SessionServicer(session_pb2_grpc.SessionServiceServicer):
    def __init__(self, services: Services) -> None:
        self.svc = services.sessions

    async def OpenSession(self, request, context):
        prompt = tuple(request.prompt_token_ids)
        session = await to_thread(self.svc.open, request.job_id, request.session_id, prompt)
        return c.session_to_pb(session)

    async def OpenSessionGroup(self, request, context):
        prompt = tuple(request.prompt_token_ids)
        group_id, sessions = await to_thread(
            self.svc.open_group, request.job_id, request.group_id, prompt, request.n
        )
        return c.session_group_to_pb(group_id, sessions)

    async def Turn(self, request, context):
        inputs, sampling = tuple(request.input_token_ids), c.sampling_from_pb(request.sampling)
        session, turn = await self.svc.turn(
            request.session_id, request.turn_index, inputs, sampling
        )
        return session_pb2.TurnResponse(turn=c.turn_to_pb(turn), num_tokens=session.num_tokens)

    async def GetSession(self, request, context):
        return c.session_to_pb(await to_thread(self.svc.get, request.session_id))

    async def CloseSession(self, request, context):
        return c.session_to_pb(await to_thread(self.svc.close, request.session_id))

    async def ListSessions(self, request, context):
        statuses = c.session_statuses_from_pb(request.statuses)
        found = await to_thread(self.svc.list, request.job_id, statuses, request.limit)
        return session_pb2.ListSessionsResponse(
            sessions=[c.session_summary_to_pb(s) for s in found]
        )


class PolicyServicer(policy_pb2_grpc.PolicyServiceServicer):
    def __init__(self, services: Services) -> None:
        self.svc = services.policy
        self.pushes = services.pushes
        self.broadcasts = services.broadcasts

    async def UpdatePolicy(self, request, context):
        source, path = c.policy_source_from_pb(request)
        policy = await to_thread(self.svc.update, request.job_id, source, path, request.note)
        return policy_pb2.UpdatePolicyResponse(policy=c.policy_to_pb(policy))

    async def GetPolicy(self, request, context):
        version = request.version if request.HasField("version") else None
        return c.policy_to_pb(await to_thread(self.svc.get, request.job_id, version))

    async def PushPolicy(self, request_iterator, context):
        # Chunks arrive decoded already (tltd.api.push_wire), other messages as protobufs.
        parts = (
            m if isinstance(m, TensorChunk) else c.push_part_from_pb(m)
            async for m in request_iterator
        )
        status, policy = await self.pushes.receive(parts)
        return policy_pb2.PushPolicyResponse(
            status=c.push_status_to_pb(status), policy=c.policy_to_pb(policy) if policy else None
        )

    async def OpenBroadcast(self, request, context):
        header = c.push_header_from_pb(request.header)
        opened = await to_thread(
            self.broadcasts.open, header, request.backend, request.timeout_seconds
        )
        return c.broadcast_group_to_pb(opened)

    async def GetPush(self, request, context):
        status = await to_thread(self.pushes.status, request.job_id, request.update_id)
        return c.push_status_to_pb(status)


class DrafterServicer(drafter_pb2_grpc.DrafterServiceServicer):
    def __init__(self, services: Services) -> None:
        self.svc = services.drafters

    async def ListDrafters(self, request, context):
        drafters, active = await to_thread(self.svc.list, request.job_id)
        return drafter_pb2.ListDraftersResponse(
            drafters=[c.drafter_to_pb(v) for v in drafters], active_version=active
        )

    async def GetDrafter(self, request, context):
        return c.drafter_to_pb(await to_thread(self.svc.get, request.job_id, request.version))

    async def PinDrafter(self, request, context):
        pinned, active = await to_thread(self.svc.pin, request.job_id, request.version)
        return drafter_pb2.PinDrafterResponse(
            drafter=c.drafter_to_pb(pinned) if pinned else None, active_version=active
        )

    async def ExportDrafter(self, request, context):
        path, files = await to_thread(
            self.svc.export, request.job_id, request.version, request.output_dir, request.format
        )
        return drafter_pb2.ExportDrafterResponse(path=path, files=files)


class JobServicer(job_pb2_grpc.JobServiceServicer):
    def __init__(self, services: Services) -> None:
        self.svc = services.jobs

    async def CreateJob(self, request, context):
        job, _created = await to_thread(self.svc.create, c.new_job_from_pb(request))
        return c.job_to_pb(job)

    async def GetJob(self, request, context):
        return c.job_to_pb(await to_thread(self.svc.get, request.job_id))

    async def ListJobs(self, request, context):
        statuses = c.job_statuses_from_pb(request.statuses)
        jobs = await to_thread(self.svc.list, statuses, request.limit)
        return job_pb2.ListJobsResponse(jobs=[c.job_to_pb(j) for j in jobs])

    async def CancelJob(self, request, context):
        return c.job_to_pb(await to_thread(self.svc.cancel, request.job_id, request.reason))


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, services: Services) -> None:
        self.svc = services.admin

    async def ListDevices(self, request, context):
        devices = await to_thread(self.svc.list_devices)
        return admin_pb2.ListDevicesResponse(devices=[c.device_to_pb(d) for d in devices])

    async def ListWorkers(self, request, context):
        workers = await to_thread(self.svc.list_workers, request.device_id)
        return admin_pb2.ListWorkersResponse(workers=[c.worker_to_pb(w) for w in workers])

    async def Cordon(self, request, context):
        if request.node_id and not request.device_id:
            devices = await to_thread(self.svc.cordon_node, request.node_id, request.reason)
            return c.device_to_pb(devices[0]) if devices else admin_pb2.Device()
        return c.device_to_pb(await to_thread(self.svc.cordon, request.device_id, request.reason))

    async def Uncordon(self, request, context):
        if request.node_id and not request.device_id:
            devices = await to_thread(self.svc.uncordon_node, request.node_id)
            return c.device_to_pb(devices[0]) if devices else admin_pb2.Device()
        return c.device_to_pb(await to_thread(self.svc.uncordon, request.device_id))

    async def Drain(self, request, context):
        devices = await to_thread(
            self.svc.drain,
            request.device_id,
            request.node,
            "",
            request.grace_seconds,
            request.node_id,
        )
        return admin_pb2.DrainResponse(devices=[c.device_to_pb(d) for d in devices])

    async def GetStats(self, request, context):
        return c.stats_to_pb(await to_thread(self.svc.stats))

    async def ListNodes(self, request, context):
        nodes = await to_thread(self.svc.list_nodes)
        return admin_pb2.ListNodesResponse(nodes=[c.node_to_pb(n) for n in nodes])


def add_servicers(server, services: Services) -> list[str]:
    """Register every tltd service on `server`; returns their full names (for health/reflection)."""
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(RolloutServicer(services), server)
    policy_pb2_grpc.add_PolicyServiceServicer_to_server(PolicyServicer(services), server)
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(DrafterServicer(services), server)
    job_pb2_grpc.add_JobServiceServicer_to_server(JobServicer(services), server)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(services), server)
    session_pb2_grpc.add_SessionServiceServicer_to_server(SessionServicer(services), server)
    return [
        rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name,
        policy_pb2.DESCRIPTOR.services_by_name["PolicyService"].full_name,
        drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name,
        job_pb2.DESCRIPTOR.services_by_name["JobService"].full_name,
        admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
        session_pb2.DESCRIPTOR.services_by_name["SessionService"].full_name,
    ]
