"""What clients in other languages rely on, over a real server: reflection v1 (grpcurl, Postman) beside
v1alpha, google.rpc.Status details on errors (grpcio-status) with the status code and message unchanged,
and the wrapper-free `chat` prompt beside the old `messages`."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.rpc import error_details_pb2, status_pb2
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha
from grpc_status import rpc_status
from support.grpc_server import ServerThread, rpc_error
from support.tiny_models import make_tiny_model

from nanoplane.clients import Client
from nanoplane.controlplane.errors import InvalidField, status_details
from nanoplane.controlplane.grpc_server import SERVICE
from nanoplane.proto.nanoplane.v1 import generation_pb2 as pb
from nanoplane.proto.nanoplane.v1 import generation_pb2_grpc as pb_grpc

CHAT = [pb.ChatMessage(role="user", content="the quick brown fox")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerThread(str(make_tiny_model(tmp_path_factory.mktemp("contracts") / "tiny", arch="qwen3", seed=3)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GenerationStub(channel)


def _v1(name: str):
    """A grpc.reflection.v1 message class, from the descriptor the server registered."""
    pool = descriptor_pool.Default()
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"grpc.reflection.v1.{name}"))


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_and_describes_in_both_versions(server, version):
    request, response = (_v1("ServerReflectionRequest"), _v1("ServerReflectionResponse")) if version == "v1" \
        else (v1alpha.ServerReflectionRequest, v1alpha.ServerReflectionResponse)
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                     request_serializer=request.SerializeToString,
                                     response_deserializer=response.FromString)
        listed, described, itself = call(iter([request(list_services=""), request(file_containing_symbol=SERVICE),
                                               request(file_containing_symbol=f"grpc.reflection.{version}"
                                                                              ".ServerReflection")]))
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= names, names
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in described.file_descriptor_response.file_descriptor_proto]
    assert any(f.package == "nanoplane.v1" and f.options.go_package for f in files), [f.name for f in files]
    own = descriptor_pb2.FileDescriptorProto.FromString(itself.file_descriptor_response.file_descriptor_proto[0])
    assert own.package == f"grpc.reflection.{version}" and own.service[0].name == "ServerReflection"


def _violations(err: grpc.RpcError) -> list[tuple[str, str]]:
    status = rpc_status.from_call(err)
    assert status is not None, "no google.rpc.Status in the trailers"
    assert status.code == err.code().value[0] and status.message == err.details()
    found = []
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        assert detail.Unpack(bad), detail.type_url
        found += [(v.field, v.description) for v in bad.field_violations]
    return found


@pytest.mark.parametrize(("request_", "field", "words"), [
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=2.0)), "sampling.top_p", "top_p"),
    (pb.GenerateRequest(chat=[pb.ChatMessage(content="no role")]), "chat[0].role", "no role"),
    (pb.GenerateRequest(messages=pb.ChatMessages()), "messages.messages", "messages is empty"),
    (pb.GenerateRequest(request_id="x" * 300, text="hi"), "request_id", "300 characters"),
    (pb.GenerateRequest(), "prompt", "no prompt"),
    (pb.GenerateRequest(text="hi", chat=CHAT), "chat", "both set"),
])
def test_invalid_argument_names_the_field_in_a_bad_request(stub, request_, field, words):
    err = rpc_error(lambda: list(stub.Generate(request_, timeout=30)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.details(), err
    assert _violations(err) == [(field, err.details())]


def test_retry_info_rides_with_exhausted_and_unavailable():
    for code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
        trailers = dict(status_details("/nanoplane.v1.Generation/Generate", code, "retry later", RuntimeError()))
        decoded = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
        info = error_details_pb2.RetryInfo()
        assert decoded.code == code.value[0] and decoded.details[0].Unpack(info)
        assert info.retry_delay.ToMilliseconds() == 1000
    trailers = status_details("/x/y", grpc.StatusCode.INVALID_ARGUMENT, "bad", InvalidField("f", "bad"))
    assert trailers and trailers[0][0] == "grpc-status-details-bin"


def test_chat_without_the_wrapper_matches_messages(server, stub):
    greedy = pb.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    old = [r for r in stub.Generate(pb.GenerateRequest(messages=pb.ChatMessages(messages=CHAT), sampling=greedy))]
    new = [r for r in stub.Generate(pb.GenerateRequest(chat=CHAT, sampling=greedy))]
    tokens = [[t for r in rs for t in r.token_ids] for rs in (old, new)]
    assert tokens[0] == tokens[1] and len(tokens[1]) == 8, tokens
    assert new[0].usage.prompt_tokens == old[0].usage.prompt_tokens > 0
    tokenized = stub.Tokenize(pb.TokenizeRequest(chat=CHAT))
    assert list(tokenized.token_ids) == list(stub.Tokenize(pb.TokenizeRequest(messages=pb.ChatMessages(
        messages=CHAT))).token_ids)
    err = rpc_error(lambda: stub.Tokenize(pb.TokenizeRequest(text="a", chat=CHAT)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and _violations(err)[0][0] == "chat"
    with Client(server.address) as client:  # the Python client's messages= still works (the old wrapper)
        assert client.tokenize(messages=[{"role": "user", "content": "the quick brown fox"}]) == \
            list(tokenized.token_ids)
