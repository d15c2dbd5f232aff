"""Docker's HEALTHCHECK: exit 0 when grpc.health.v1 says SERVING, 1 otherwise.

Kubernetes needs none of this (its probes speak gRPC health natively); Docker runs a command.
Usage: python healthcheck.py [HOST:PORT] [SERVICE]
"""

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    address = argv[1] if len(argv) > 1 else "127.0.0.1:50051"
    service = argv[2] if len(argv) > 2 else ""
    with grpc.insecure_channel(address) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        except grpc.RpcError as error:
            print(f"unhealthy: {error.code().name}", file=sys.stderr)
            return 1
    serving = answer.status == health_pb2.HealthCheckResponse.SERVING
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
