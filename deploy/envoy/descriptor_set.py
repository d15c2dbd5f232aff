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

from service.reflection import ERROR_DETAILS, with_imports

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVICE_SET = ROOT / "service" / "descriptors.binpb"
OUTPUT = ROOT / "deploy" / "envoy" / "descriptors.binpb"


def descriptor_set() -> bytes:
    service = descriptor_pb2.FileDescriptorSet.FromString(SERVICE_SET.read_bytes())
    names = {f.name for f in service.file}
    combined = descriptor_pb2.FileDescriptorSet(file=[f for f in with_imports(*ERROR_DETAILS) if f.name not in names])
    combined.file.extend(service.file)
    return combined.SerializeToString(deterministic=True)


if __name__ == "__main__":
    pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else OUTPUT).write_bytes(descriptor_set())
