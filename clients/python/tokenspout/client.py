"""A small Python client: stream a generation and print it as it arrives.

    python -m tokenspout.client --target 127.0.0.1:50051 "Why is the sky blue?"
"""

from __future__ import annotations

import argparse
import sys
from typing import Iterator

import grpc

from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc


class TokenspoutClient:
    def __init__(self, target: str, credentials: grpc.ChannelCredentials | None = None) -> None:
        self._channel = (
            grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
        )
        self.stub = pb_grpc.GenerationServiceStub(self._channel)

    def stream_chat(
        self, user_message: str, max_new_tokens: int = 128, temperature: float | None = None, timeout: float = 60.0
    ) -> Iterator[pb.GenerateStreamResponse]:
        request = pb.GenerateStreamRequest(
            chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=user_message)]),
            stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens),
        )
        if temperature is not None:
            request.sampling.temperature = temperature
        return self.stub.GenerateStream(request, timeout=timeout)

    def close(self) -> None:
        self._channel.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Stream a chat answer from tokenspout.")
    parser.add_argument("message")
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float)
    args = parser.parse_args(argv)
    client = TokenspoutClient(args.target)
    try:
        for response in client.stream_chat(args.message, args.max_new_tokens, args.temperature):
            sys.stdout.write(response.text)
            sys.stdout.flush()
            if response.HasField("finish"):
                finish = response.finish
                reason = pb.FinishReason.Name(finish.reason).removeprefix("FINISH_REASON_").lower()
                print(
                    f"\n[{reason}: {finish.usage.completion_tokens} tokens,"
                    f" first after {finish.timings.time_to_first_token_ms:.0f} ms,"
                    f" {finish.timings.tokens_per_second:.0f} tokens/s]"
                )
    except grpc.RpcError as error:
        print(f"\nerror: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
