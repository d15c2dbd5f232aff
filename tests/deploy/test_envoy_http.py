"""deploy/envoy/envoy.yaml's HTTP/JSON and gRPC-Web sides, against a live replica: curl gets
GenerateStream as Server-Sent Events, unary calls, constraints and tool calls as JSON, errors as JSON
google.rpc.Status (as trailers once a stream has begun), and closing the connection frees the
replica's slot; a Node gRPC-Web client (Connect's, from npm) streams through the grpc_web filter."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from tests.harness.helpers import greedy, text_of, wait_for
from tests.harness.proxies import Envoy, start_replicas, stop_replicas
from tests.harness.typescript import TYPESCRIPT, build_typescript_client
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

SERVICE = "tokenspout.v1.GenerationService"
PROMPT = "The sea is"


@pytest.fixture(scope="module")
def envoy(tmp_path_factory, model_path):
    tmp = tmp_path_factory.mktemp("envoy-http")
    (replica,) = start_replicas(tmp, 1)
    proxy = Envoy(tmp, [replica.address])
    yield proxy, replica
    proxy.stop()
    stop_replicas([replica])


def call(proxy: Envoy, method: str, body: dict, *flags: str) -> tuple[int, dict[str, str], str]:
    """POST a JSON body with curl; the HTTP status, headers and body (trailers stay in the body)."""
    result = subprocess.run(
        ["curl", "-sS", "-i", "-N", *flags, f"{proxy.url}/{SERVICE}/{method}", "-H", "content-type: application/json",
         "-d", json.dumps(body)], capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    head, _, rest = result.stdout.replace("\r\n", "\n").partition("\n\n")
    status_line, *lines = head.splitlines()
    headers = {name.lower(): value for name, _, value in (line.partition(": ") for line in lines)}
    return int(status_line.split()[1]), headers, rest


def events(body: str) -> list[dict]:
    """The `data:` events of a Server-Sent Events body."""
    return [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]


def trailers(body: str) -> dict[str, str]:
    """HTTP/1.1 chunked trailers curl prints after the body."""
    return dict(re.findall(r"^(grpc-[a-z-]+): (.*)$", body, re.M))


def request_json(max_new_tokens: int, **extra) -> dict:
    return {"prompt": PROMPT, "sampling": {"temperature": 0}, "stopping": {"maxNewTokens": max_new_tokens}, **extra}


def test_a_stream_as_server_sent_events(envoy):
    proxy, replica = envoy
    status, headers, body = call(proxy, "GenerateStream", request_json(12, output={"returnTokenIds": True}))
    assert status == 200 and headers["content-type"] == "text/event-stream"
    messages = events(body)
    assert [m["generatedTokens"] for m in messages] == list(range(1, 13)), "one event per message"
    assert messages[-1]["finish"]["reason"] == "FINISH_REASON_MAX_TOKENS"
    assert all("finish" not in m for m in messages[:-1])
    # The same text as the replica streams over gRPC.
    with grpc.insecure_channel(replica.address) as channel:
        direct = list(pb_grpc.GenerationServiceStub(channel).GenerateStream(greedy(PROMPT, 12), timeout=60))
    assert "".join(m.get("text", "") for m in messages) == text_of(direct)


def test_unary_calls_as_json(envoy):
    proxy, _ = envoy
    status, headers, body = call(proxy, "Generate", request_json(6))
    answer = json.loads(body)
    assert status == 200 and headers["content-type"] == "application/json"
    assert answer["generatedTokens"] == 6 and answer["finish"]["usage"]["promptTokens"] > 0
    status, _, body = call(proxy, "Tokenize", {"text": "Hello world"})
    assert status == 200 and json.loads(body)["count"] >= 2
    status, _, body = call(proxy, "GetServerStatus", {})
    assert status == 200 and json.loads(body)["maxBatchSize"] == 8


def test_a_json_schema_constraint(envoy):
    proxy, _ = envoy
    schema = {"type": "object", "properties": {"year": {"type": "integer"}}, "required": ["year"],
              "additionalProperties": False}
    body = {"prompt": "The year the first man walked on the moon, as JSON:", "sampling": {"temperature": 0},
            "stopping": {"maxNewTokens": 40}, "constraint": {"jsonSchema": json.dumps(schema)}}
    status, _, answer = call(proxy, "Generate", body)
    assert status == 200, answer
    generated = json.loads(answer)
    value = json.loads(generated["text"])
    assert set(value) == {"year"} and isinstance(value["year"], int), generated
    assert generated["finish"]["constraintSatisfied"] is True


WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "parameters": json.dumps({"type": "object", "properties": {"city": {"type": "string"}},
                                     "required": ["city"]})}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def tool_request(messages: list[dict], mode: str) -> dict:
    # Seeded: the grammar forces a call, the seed keeps the model's arguments short enough to close.
    return {"chat": {"messages": messages, "tools": [WEATHER], "toolChoice": {"mode": f"TOOL_CHOICE_MODE_{mode}"},
                     "parallelToolCalls": False},
            "sampling": {"seed": 5}, "stopping": {"maxNewTokens": 64}}


def test_a_tool_call_round_trip_as_json(envoy):
    """The typed tool fields survive transcoding: toolCalls in a unary answer, toolCallDeltas in
    Server-Sent Events, and a call sent back in JSON gets a plain answer."""
    proxy, _ = envoy
    status, _, body = call(proxy, "Generate", tool_request(ASK_WEATHER, "REQUIRED"))
    assert status == 200, body
    answer = json.loads(body)
    assert answer["finish"]["reason"] == "FINISH_REASON_TOOL_CALLS", answer
    (tool_call,) = answer["toolCalls"]
    assert tool_call["name"] == "get_weather" and isinstance(json.loads(tool_call["arguments"])["city"], str)

    status, headers, body = call(proxy, "GenerateStream", tool_request(ASK_WEATHER, "REQUIRED"))
    assert status == 200 and headers["content-type"] == "text/event-stream"
    messages = events(body)
    deltas = [d for m in messages for d in m.get("toolCallDeltas", [])]
    assert deltas and deltas[0]["name"] == "get_weather" and deltas[0]["id"].startswith("call_"), messages
    # JSON omits the zero index; every delta belongs to the one call.
    assert all(d.get("index", 0) == 0 for d in deltas)
    (streamed,) = [c for m in messages for c in m.get("toolCalls", [])]
    assert "".join(d.get("argumentsDelta", "") for d in deltas) == streamed["arguments"]
    assert messages[-1]["finish"]["reason"] == "FINISH_REASON_TOOL_CALLS"

    result = {"role": "tool", "toolCallId": streamed["id"], "content": json.dumps({"sky": "clear", "celsius": 21})}
    back = [*ASK_WEATHER, {"role": "assistant", "toolCalls": [streamed]}, result]
    status, _, body = call(proxy, "Generate", {**tool_request(back, "NONE"), "stopping": {"maxNewTokens": 24}})
    assert status == 200, body
    answer = json.loads(body)
    assert answer.get("text", "").strip() and "toolCalls" not in answer, answer


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_invalid_argument_as_json_status_with_its_field_violations(envoy, method):
    proxy, _ = envoy
    status, headers, body = call(proxy, method, {**request_json(4), "sampling": {"temperature": 5000}})
    assert status == 400 and headers["content-type"] == "application/json"
    error = json.loads(body)
    assert error["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    kinds = {detail["@type"].rsplit("/", 1)[1]: detail for detail in error["details"]}
    assert kinds["google.rpc.ErrorInfo"]["reason"] == "INVALID_REQUEST"
    violations = kinds["google.rpc.BadRequest"]["fieldViolations"]
    assert [v["field"] for v in violations] == ["sampling.temperature"]


def test_closing_the_connection_frees_the_slot(envoy):
    proxy, replica = envoy

    def running() -> int:
        return json.loads(call(proxy, "GetServerStatus", {})[2]).get("runningSequences", 0)

    cancelled_before = int(json.loads(call(proxy, "GetServerStatus", {})[2]).get("cancelledTotal", 0))
    body = {"requestId": "closed-by-curl", "prompt": PROMPT, "stopping": {"maxNewTokens": 400, "ignoreEos": True}}
    curl = subprocess.Popen(
        ["curl", "-sS", "-N", f"{proxy.url}/{SERVICE}/GenerateStream", "-H", "content-type: application/json",
         "-d", json.dumps(body)], stdout=subprocess.PIPE, text=True,
    )
    try:
        assert curl.stdout.readline().startswith("data: "), "the stream began"
        assert running() == 1
    finally:
        curl.kill()
        curl.wait(timeout=10)
    replica.wait_for_log("request closed-by-curl ended by the caller: cancelled")
    wait_for(lambda: running() == 0, what="the slot to be freed")
    assert int(json.loads(call(proxy, "GetServerStatus", {})[2])["cancelledTotal"]) == cancelled_before + 1


def test_an_error_after_the_stream_began_arrives_as_trailers(tmp_path, model_path):
    """A replica draining with a 1 s grace period ends a long stream with UNAVAILABLE: the events
    so far, no finish, then grpc-status, grpc-message and the google.rpc.Status as trailers."""
    (replica,) = start_replicas(tmp_path, 1, "--grace-period-s", "1")
    proxy = Envoy(tmp_path, [replica.address])
    try:
        body = {"prompt": PROMPT, "stopping": {"maxNewTokens": 400, "ignoreEos": True}}
        curl = subprocess.Popen(
            ["curl", "-sS", "-i", "-N", f"{proxy.url}/{SERVICE}/GenerateStream", "-H", "content-type: application/json",
             "-d", json.dumps(body)], stdout=subprocess.PIPE, text=True,
        )
        while not curl.stdout.readline().startswith("data: "):
            pass
        replica.process.send_signal(signal.SIGTERM)
        rest = curl.communicate(timeout=60)[0]
        assert curl.returncode == 0
        ended = trailers(rest)
        assert events(rest) and all("finish" not in m for m in events(rest))
        assert ended["grpc-status"] == str(grpc.StatusCode.UNAVAILABLE.value[0]), rest[-500:]
        status = status_pb2.Status.FromString(base64.b64decode(ended["grpc-status-details-bin"] + "=="))
        info = error_details_pb2.ErrorInfo()
        assert status.details[0].Unpack(info) and info.reason == "DRAINING"
    finally:
        proxy.stop()
        stop_replicas([replica])


def test_a_grpc_web_client_streams_through_envoy(envoy):
    proxy, replica = envoy
    build_typescript_client()
    env = {**os.environ, "ENVOY_URL": proxy.url, "PROMPT": PROMPT, "MAX_NEW_TOKENS": "10"}
    result = subprocess.run(["node", "test/grpc-web.mjs"], cwd=TYPESCRIPT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    # Streamed: several messages, each carrying at least one new token (speculation may put several in one).
    counts = seen["counts"]
    assert len(counts) > 1 and all(a < b for a, b in zip(counts, counts[1:])), counts
    assert counts[-1] == seen["finish"]["generatedTokens"] == 10
    with grpc.insecure_channel(replica.address) as channel:
        direct = list(pb_grpc.GenerationServiceStub(channel).GenerateStream(greedy(PROMPT, 10, ignore_eos=True), timeout=60))
    assert "".join(seen["texts"]) == text_of(direct)
    assert seen["error"] == {"code": grpc.StatusCode.INVALID_ARGUMENT.value[0], "reason": "INVALID_REQUEST",
                             "fields": ["sampling.temperature"]}
    # Envoy's grpc_web filter bridged both calls (its per-method counters).
    counters = dict(re.findall(r"grpc-web\.tokenspout\.v1\.GenerationService\.GenerateStream\.(\w+): (\d+)",
                               proxy.stats("grpc-web")))
    assert int(counters["success"]) >= 1 and int(counters["failure"]) >= 1, counters
