"""The Go, Java and C++ examples (clients/go, clients/java, clients/cpp): code generated from protos/
with Debian's plugins, built against Debian's gRPC, and run against a live server with API keys on.

Each example cancels a stream after three tokens, streams a chat printing a line per message, and
sends an invalid request; with --tools it does a tool call round trip instead. The three print the
same lines, so one set of checks reads them all."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time

import grpc
import pytest

from tests.harness.helpers import bad_request_fields, rpc_error, wait_for
from tests.harness.servers import REPORT, ROOT, start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

LANGUAGES = ("go", "java", "cpp")
KEY = "generated-clients-key"
BEARER = (("authorization", f"Bearer {KEY}"),)
CODE = re.compile(r"\S+ \((\d+)\)")  # "NAME (number)": each language names the codes its own way
CALL = re.compile(r"tool (streamed|call): (call_[A-Za-z0-9]{24}) (\S+) (.+)")  # "... ID NAME ARGUMENTS"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, model_path):
    env = {"TOKENSPOUT_API_KEYS": f"examples:{hashlib.sha256(KEY.encode()).hexdigest()}"}
    server = start_server(tmp_path_factory.mktemp("keyed"), "--max-batch-size", "4", "--context-length", "1024",
                          env=env)
    yield server
    assert stop_server(server) == 0, server.log()


@pytest.fixture(scope="module")
def stub(keyed):
    with grpc.insecure_channel(keyed.address) as channel:
        yield pb_grpc.GenerationServiceStub(channel)


@pytest.fixture(scope="module", params=LANGUAGES)
def example(request):
    """The language's example, generated and built by clients/<language>/Makefile, once per run."""
    language = request.param
    assert (ROOT / "node_modules" / ".bin" / "buf").exists(), "run `make tools` (buf)"
    started = time.monotonic()
    build = subprocess.run(["make", "-C", f"clients/{language}", f"PYTHON={sys.executable}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, f"`make client-tools` installs the Debian packages\n{build.stdout}{build.stderr}"
    REPORT.append(f"generated clients: {language} example generated and built in {time.monotonic() - started:.1f} s")
    return ROOT / "build" / "clients" / language / "tokenspout-example"


def run(example, keyed, *flags: str, key: str | None = KEY) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TOKENSPOUT_API_KEY"}
    if key is not None:
        env["TOKENSPOUT_API_KEY"] = key
    return subprocess.run([str(example), "--address", keyed.address, *flags], env=env, capture_output=True,
                          text=True, timeout=120)


def server_status(stub) -> pb.GetServerStatusResponse:
    return stub.GetServerStatus(pb.GetServerStatusRequest(), metadata=BEARER, timeout=10)


def test_streams_a_chat_cancels_a_stream_and_decodes_an_invalid_request(example, keyed, stub):
    before = server_status(stub)
    process = subprocess.Popen([str(example), "--address", keyed.address, "--max-new-tokens", "128"],
                               env={**os.environ, "TOKENSPOUT_API_KEY": KEY}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(120, process.kill)
    watchdog.start()

    def cancelled_while_running():
        status = server_status(stub)  # before the poll: the example ran at least until this status
        return status.cancelled_total > before.cancelled_total and (status, process.poll() is None)

    lines, while_streaming, alive = [], None, False
    try:
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if while_streaming is None and line.startswith("token "):
                # The example has printed its first chat token: by now the server has freed the
                # stream it cancelled, and it is still generating the chat.
                while_streaming, alive = wait_for(cancelled_while_running, what="the server to free the cancelled stream")
        stderr = process.stderr.read()
        returncode = process.wait()
    finally:
        watchdog.cancel()
        process.kill()
    output = "\n".join(lines) + "\n" + stderr
    assert returncode == 0, output

    assert while_streaming is not None, output
    assert alive, f"the server freed the stream only when the example exited: it never cancelled it\n{output}"
    assert while_streaming.cancelled_total == before.cancelled_total + 1, output
    assert while_streaming.running_sequences == 1, f"the chat had ended before its first token was printed\n{output}"

    cancel = re.fullmatch(r"cancel: cancelled after (\d+) tokens: " + CODE.pattern, lines[0])
    assert cancel and int(cancel.group(1)) >= 3, output
    assert int(cancel.group(2)) == grpc.StatusCode.CANCELLED.value[0], output

    assert re.fullmatch(r"chat: [1-9]\d* prompt tokens", lines[1]), output
    counts = [int(m.group(1)) for line in lines if (m := re.fullmatch(r'token (\d+): ".+"', line))]
    finish = [m for line in lines if (m := re.fullmatch(r"finish: (FINISH_REASON_\w+) after (\d+) tokens", line))]
    assert len(counts) >= 8 and counts == sorted(set(counts)), output
    assert len(finish) == 1 and int(finish[0].group(2)) == counts[-1], output
    assert finish[0].group(1) in ("FINISH_REASON_MAX_TOKENS", "FINISH_REASON_EOS_TOKEN"), output

    invalid_index = next(i for i, line in enumerate(lines) if line.startswith("invalid request: "))
    invalid = re.match(r"invalid request: " + CODE.pattern + r" \(reason (\w+)\): ", lines[invalid_index])
    assert invalid and int(invalid.group(1)) == grpc.StatusCode.INVALID_ARGUMENT.value[0], output
    assert invalid.group(2) == "INVALID_REQUEST", output
    printed = dict(re.fullmatch(r"  violation (\S+): (.+)", line).groups() for line in lines[invalid_index + 1:])
    # The same request through the Python stub: the example decoded every violation, word for word.
    request = pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(temperature=-1, top_p=2))
    expected = bad_request_fields(rpc_error(lambda: stub.Generate(request, metadata=BEARER, timeout=10)))
    assert printed == expected and set(expected) == {"sampling.temperature", "sampling.top_p"}, output


def test_a_wrong_or_missing_key_is_unauthenticated(example, keyed):
    for key, message in (("not-the-key", "the API key was not accepted"), (None, "this server needs an API key")):
        result = run(example, keyed, key=key)
        assert result.returncode == 1, result.stdout + result.stderr
        error = re.match(r"error: " + CODE.pattern + r" \(reason (\w+)\): (.*)", result.stdout)
        assert error, result.stdout + result.stderr
        assert int(error.group(1)) == grpc.StatusCode.UNAUTHENTICATED.value[0], result.stdout
        assert error.group(2) == "UNAUTHENTICATED" and message in error.group(3), result.stdout


def test_each_call_carries_the_deadline(example, keyed):
    result = run(example, keyed, "--timeout", "0.001")
    assert result.returncode == 1, result.stdout + result.stderr
    error = re.match(r"error: " + CODE.pattern, result.stdout)
    assert error and int(error.group(1)) == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], result.stdout


def test_a_tool_call_round_trip(example, keyed):
    """--tools: a required get_weather call, assembled from the streamed deltas, then its result sent
    back with tool choice none for a text answer."""
    result = run(example, keyed, "--tools")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    lines = result.stdout.splitlines()

    calls = {"streamed": [], "call": []}
    for match in filter(None, map(CALL.fullmatch, lines)):
        calls[match.group(1)].append(match.groups()[1:])
    assert len(calls["call"]) == 1, output  # parallel_tool_calls off: one call
    assert calls["streamed"] == calls["call"], f"the deltas joined are not the call\n{output}"
    (_, name, arguments), = calls["call"]
    assert name == "get_weather", output
    assert isinstance(json.loads(arguments).get("city"), str), output
    assert "tool finish: FINISH_REASON_TOOL_CALLS" in lines, output

    answer = [m.group(1) for line in lines if (m := re.fullmatch(r'answer: "(.*)"', line))]
    assert len(answer) == 1 and re.sub(r"\\[nrt]", "", answer[0]).strip(), output  # escapes aside, not blank
    finish = [m.groups() for line in lines if (m := re.fullmatch(r"answer finish: (FINISH_REASON_\w+), (\d+) tool calls", line))]
    assert len(finish) == 1 and finish[0][1] == "0" and finish[0][0] != "FINISH_REASON_TOOL_CALLS", output
