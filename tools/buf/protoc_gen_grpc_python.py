"""A protoc plugin that runs grpcio-tools' gRPC Python generator.

grpcio-tools ships the generator inside its bundled protoc, not as a
`protoc-gen-grpc_python` executable, so buf cannot call it directly. This shim
takes buf's CodeGeneratorRequest, hands the descriptors to that protoc and
returns the files it wrote.
"""

import pathlib
import sys
import tempfile

from google.protobuf import descriptor_pb2
from google.protobuf.compiler import plugin_pb2
from grpc_tools import protoc


def main() -> None:
    request = plugin_pb2.CodeGeneratorRequest.FromString(sys.stdin.buffer.read())
    response = plugin_pb2.CodeGeneratorResponse(
        supported_features=plugin_pb2.CodeGeneratorResponse.FEATURE_PROTO3_OPTIONAL
    )
    with tempfile.TemporaryDirectory() as tmp:
        descriptors = pathlib.Path(tmp, "descriptors.pb")
        descriptors.write_bytes(descriptor_pb2.FileDescriptorSet(file=request.proto_file).SerializeToString())
        out = pathlib.Path(tmp, "out")
        out.mkdir()
        args = ["protoc", f"--descriptor_set_in={descriptors}", f"--grpc_python_out={out}", *request.file_to_generate]
        if protoc.main(args) != 0:
            response.error = "grpc_tools.protoc failed: " + " ".join(args)
        for path in sorted(out.rglob("*.py")):
            response.file.add(name=str(path.relative_to(out)), content=path.read_text())
    sys.stdout.buffer.write(response.SerializeToString())


if __name__ == "__main__":
    main()
