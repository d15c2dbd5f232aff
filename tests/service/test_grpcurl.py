"""grpcurl, with no .proto files, through server reflection: what a person would type."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

from tests.harness.faults import StepGate
from tests.harness.helpers import wait_for
from tests.harness.servers import start_server, stop_server

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


def details(stderr: str) -> list[dict]:
    """The google.rpc details grpcurl printed for an error, each as JSON (it prints an unknown type as base64)."""
    return [json.loads(line.split(")", 1)[1]) for line in stderr.splitlines() if re.match(r"\s+\d+\)\s", line)]


def test_grpcurl_prints_every_error_detail_readably(tmp_path):
    """Reflection serves google.rpc's detail types, so grpcurl shows ErrorInfo's reason, BadRequest's fields and
    RetryInfo's delay (not "google.rpc.ErrorInfo is not recognized" and base64)."""
    gate = StepGate(tmp_path / "steps")
    gate.hold_at(0)  # the engine holds the one request it admits: the next one finds the server full
    server = start_server(tmp_path, "--max-batch-size", "1", "--max-queued-requests", "0",
                          faults=("--step-gate", str(gate.path)), fake_engine=True)
    holder = None
    try:
        bad = grpcurl(server, "tokenspout.v1.GenerationService/Generate", data={"prompt": "hi", "sampling": {"topP": 2}})
        assert "Code: InvalidArgument" in bad.stderr and "not recognized" not in bad.stderr, bad.stderr
        assert details(bad.stderr) == [
            {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "domain": "tokenspout.v1", "reason": "INVALID_REQUEST"},
            {"@type": "type.googleapis.com/google.rpc.BadRequest",
             "field_violations": [{"field": "sampling.top_p", "description": "must be in (0.0, 1.0]"}]},
        ]
        holder = subprocess.Popen([GRPCURL, "-plaintext", "-d", json.dumps({"prompt": "hold", "stopping": {"maxNewTokens": 4}}),
                                   server.address, "tokenspout.v1.GenerationService/GenerateStream"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def holding() -> bool:
            status = json.loads(grpcurl(server, "tokenspout.v1.GenerationService/GetServerStatus").stdout)
            return status.get("runningSequences", 0) + status.get("queuedRequests", 0) == 1

        wait_for(holding, 60, "the held request to take the only place")
        full = grpcurl(server, "tokenspout.v1.GenerationService/Generate", data={"prompt": "more"})
        assert "Code: ResourceExhausted" in full.stderr and "not recognized" not in full.stderr, full.stderr
        info, retry = details(full.stderr)
        assert info["reason"] == "OVERLOADED" and info["@type"].endswith("google.rpc.ErrorInfo")
        assert retry == {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retry_delay": "1s"}
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        gate.open()
        assert stop_server(server) == 0
