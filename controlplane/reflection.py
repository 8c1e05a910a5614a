"""Server reflection in both versions: grpc.reflection.v1 (grpcurl, Postman, buf curl) and v1alpha.

grpcio-reflection serves v1alpha only. v1 is the same protocol under another package name: the same
messages with the same field numbers, so v1alpha's servicer answers v1 calls byte for byte. Its
descriptor, made from v1alpha's by renaming the package, goes into the default pool, so that a
client that describes the v1 service itself finds it too.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha

V1_SERVICE = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _add_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
        return  # registered already (by this module before, or by a v1 module of grpcio's one day)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha.DESCRIPTOR.CopyToProto(proto)
    old = f".{proto.package}."
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    for message in proto.message_type:
        for f in message.field:
            if f.type_name.startswith(old):
                f.type_name = ".grpc.reflection.v1." + f.type_name[len(old):]
    for service in proto.service:
        for method in service.method:
            method.input_type = ".grpc.reflection.v1." + method.input_type[len(old):]
            method.output_type = ".grpc.reflection.v1." + method.output_type[len(old):]
    pool.Add(proto)


def enable_reflection(service_names: list[str], server: grpc.aio.Server) -> None:
    """Reflection on `server` for `service_names`, both reflection services and health listed with them."""
    _add_v1_descriptor()
    names = (*service_names, reflection.SERVICE_NAME, V1_SERVICE)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection.enable_server_reflection(names, server)  # v1alpha, with its own servicer
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha.ServerReflectionRequest.FromString,
        response_serializer=v1alpha.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE,
                                                                          {"ServerReflectionInfo": handler}),))
