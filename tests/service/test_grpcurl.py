"""grpcurl, with no .proto files, through server reflection: what a person would type."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

GRPCURL = shutil.which("grpcurl", path=str(pathlib.Path(sys.executable).parent)) or "grpcurl"


def grpcurl(server, *args: str, data: dict | None = None) -> subprocess.CompletedProcess:
    command = [GRPCURL, "-plaintext"]
    if data is not None:
        command += ["-d", json.dumps(data)]
    return subprocess.run([*command, server.address, *args], capture_output=True, text=True, timeout=120)


def json_stream(text: str) -> list[dict]:
    decoder, messages, index = json.JSONDecoder(), [], 0
    while index < len(text):
        if text[index].isspace():
            index += 1
            continue
        message, index = decoder.raw_decode(text, index)
        messages.append(message)
    return messages


def test_list_and_describe_through_reflection(server):
    listing = grpcurl(server, "list")
    assert listing.returncode == 0, listing.stderr
    assert {"tokenspout.v1.GenerationService", "grpc.health.v1.Health"} <= set(listing.stdout.split())
    described = grpcurl(server, "describe", "tokenspout.v1.GenerationService")
    assert "rpc GenerateStream ( .tokenspout.v1.GenerateStreamRequest ) returns ( stream" in described.stdout


def test_streaming_call_without_proto_files(server):
    result = grpcurl(
        server,
        "tokenspout.v1.GenerationService/GenerateStream",
        data={
            "chat": {"messages": [{"role": "user", "content": "Name a colour."}]},
            "sampling": {"temperature": 0},
            "stopping": {"maxNewTokens": 16, "ignoreEos": True},
        },
    )
    assert result.returncode == 0, result.stderr
    messages = json_stream(result.stdout)
    assert len(messages) > 1
    assert messages[-1]["finish"]["reason"] == "FINISH_REASON_MAX_TOKENS"
    assert int(messages[-1]["generatedTokens"]) == 16


def test_health_check(server):
    result = grpcurl(server, "grpc.health.v1.Health/Check")
    assert result.returncode == 0 and json.loads(result.stdout) == {"status": "SERVING"}


def test_errors_carry_details(server):
    result = grpcurl(
        server, "tokenspout.v1.GenerationService/GenerateStream", data={"prompt": "hi", "sampling": {"topP": 2}}
    )
    assert result.returncode != 0
    assert "Code: InvalidArgument" in result.stderr
    assert "google.rpc.BadRequest" in result.stderr and "sampling.top_p" in result.stderr


def test_sampler_messages_in_json_and_unimplemented_ones(server):
    def text(sampling: dict) -> str:
        result = grpcurl(
            server,
            "tokenspout.v1.GenerationService/GenerateStream",
            data={"prompt": "The cat sat on the mat. The cat sat on the mat. The cat",
                  "sampling": {"temperature": 0, **sampling}, "stopping": {"maxNewTokens": 24}},
        )
        assert result.returncode == 0, result.stderr
        return "".join(message.get("text", "") for message in json_stream(result.stdout))

    assert text({"dry": {"multiplier": 0.8}}) != text({})  # the JSON form reaches the sampler
    top_a = grpcurl(
        server, "tokenspout.v1.GenerationService/GenerateStream", data={"prompt": "hi", "sampling": {"topA": 0.2}}
    )
    assert "Code: Unimplemented" in top_a.stderr and "sampling.top_a" in top_a.stderr
