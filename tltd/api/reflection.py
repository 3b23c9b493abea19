"""Server reflection as `grpc.reflection.v1` (what grpcurl and newer clients ask for) and as
`grpc.reflection.v1alpha` (older clients).

grpcio-reflection ships only v1alpha. The two protos are the same messages under another
package name, so the same servicer answers both: v1 requests are read with the v1alpha message
classes (identical wire format), and the v1 service's own descriptor (v1alpha's, renamed) is
added to the descriptor pool so that reflection can describe itself under either name.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1 = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection v1 and v1alpha on `server`, listing `service_names` and both."""
    _add_v1_descriptor(descriptor_pool.Default())
    servicer = reflection.aio.ReflectionServicer([*service_names, V1, V1ALPHA])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1, {"ServerReflectionInfo": handler}),)
    )


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """v1alpha's file descriptor under the v1 package, once per pool."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    fdp.name, fdp.package = _V1_FILE, "grpc.reflection.v1"
    for message in fdp.message_type:
        for f in message.field:
            if f.type_name:  # (assigning "" would set it on a scalar field)
                f.type_name = f.type_name.replace(old, new)
    for service in fdp.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    pool.Add(fdp)
