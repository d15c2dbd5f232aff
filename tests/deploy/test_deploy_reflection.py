"""Reflection v1 and v1alpha, with the protos' comments, as grpcurl and other tools see them."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2 as rpb

from service.reflection import load_descriptor_set
from tests.service.test_grpcurl import grpcurl
from tokenspout.v1 import generation_pb2 as pb


def test_the_shipped_descriptors_match_the_generated_stubs():
    """`make proto` regenerates both; a proto edit without it fails here."""
    (shipped,) = [f for f in load_descriptor_set() if f.name == pb.DESCRIPTOR.name]
    assert shipped.source_code_info.location, "the descriptor set lost its comments"
    shipped.ClearField("source_code_info")
    assert shipped == descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)


def test_grpcurl_describe_shows_the_proto_comments(server):
    service = grpcurl(server, "describe", "tokenspout.v1.GenerationService")
    assert service.returncode == 0, service.stderr
    assert "// GenerationService streams tokens from one loaded model" in service.stdout
    method = grpcurl(server, "describe", "tokenspout.v1.GenerationService.GenerateStream")
    assert "Streams one response message per token batch" in method.stdout
    listing = grpcurl(server, "list")
    assert {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= set(listing.stdout.split())


def _ask(channel: grpc.Channel, version: str, *requests: rpb.ServerReflectionRequest) -> list[rpb.ServerReflectionResponse]:
    """The two versions share one wire format, so v1alpha's message classes serve both."""
    call = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=rpb.ServerReflectionRequest.SerializeToString,
        response_deserializer=rpb.ServerReflectionResponse.FromString,
    )
    return list(call(iter(requests), timeout=30))


def test_v1_and_v1alpha_answer_alike_with_source_info(channel):
    for version in ("v1", "v1alpha"):
        listed, by_symbol, missing, health = _ask(
            channel,
            version,
            rpb.ServerReflectionRequest(list_services=""),
            rpb.ServerReflectionRequest(file_containing_symbol="tokenspout.v1.GenerateStreamRequest"),
            rpb.ServerReflectionRequest(file_containing_symbol="tokenspout.v1.NoSuchThing"),
            rpb.ServerReflectionRequest(file_by_filename=health_pb2.DESCRIPTOR.name),
        )
        names = {s.name for s in listed.list_services_response.service}
        services = {"tokenspout.v1.GenerationService", "grpc.health.v1.Health", f"grpc.reflection.{version}.ServerReflection"}
        assert services <= names
        protos = by_symbol.file_descriptor_response.file_descriptor_proto
        (file,) = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in protos]
        assert file.name == "tokenspout/v1/generation.proto"
        comments = [loc.leading_comments for loc in file.source_code_info.location if loc.leading_comments]
        assert any("streams tokens from one loaded model" in c for c in comments)
        assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
        assert health.file_descriptor_response.file_descriptor_proto
