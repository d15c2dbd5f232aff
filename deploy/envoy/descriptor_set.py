"""Writes deploy/envoy/descriptors.binpb: the descriptor set Envoy's JSON transcoder reads.

service/descriptors.binpb (the service's protos, with comments, for reflection) plus
google.rpc.Status and the error details the service sends (google/rpc/error_details.proto) with
their imports: the transcoder needs every detail type to write an error as JSON.
Run by `make proto`; tests/deploy/test_deploy.py checks the committed file is current.

    python deploy/envoy/descriptor_set.py [OUTPUT]
"""

from __future__ import annotations

import pathlib
import sys

from google.protobuf import descriptor_pb2
from google.rpc import error_details_pb2, status_pb2

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVICE_SET = ROOT / "service" / "descriptors.binpb"
OUTPUT = ROOT / "deploy" / "envoy" / "descriptors.binpb"


def _with_imports(file, seen: dict[str, descriptor_pb2.FileDescriptorProto]) -> None:
    """`file` and what it imports, imports first (the order a descriptor set wants)."""
    if file.name in seen:
        return
    for dependency in file.dependencies:
        _with_imports(dependency, seen)
    proto = descriptor_pb2.FileDescriptorProto()
    file.CopyToProto(proto)
    seen[file.name] = proto


def descriptor_set() -> bytes:
    service = descriptor_pb2.FileDescriptorSet.FromString(SERVICE_SET.read_bytes())
    extra: dict[str, descriptor_pb2.FileDescriptorProto] = {}
    for module in (status_pb2, error_details_pb2):
        _with_imports(module.DESCRIPTOR, extra)
    names = {f.name for f in service.file}
    combined = descriptor_pb2.FileDescriptorSet(file=[f for name, f in extra.items() if name not in names])
    combined.file.extend(service.file)
    return combined.SerializeToString(deterministic=True)


if __name__ == "__main__":
    pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else OUTPUT).write_bytes(descriptor_set())
