"""The Python client (clients/python, package tokenspout-client) against the real server."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import signal
import subprocess
import sys
import threading
import uuid

import pydantic
import pytest

import tokenspout
from tests.harness.helpers import wait_for
from tests.harness.servers import ROOT, start_server, stop_server
from tokenspout import Client, Constraint, Output, RetryPolicy, Sampling, Stopping


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false

    name: str
    age: int


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=120) as connected:
        yield connected


@pytest.fixture(scope="module")
def full_server(tmp_path_factory, model_path):
    """One batch slot and no queue: a second request is refused as overloaded."""
    running = start_server(
        tmp_path_factory.mktemp("full"), "--max-batch-size", "1", "--max-queued-requests", "0",
        "--context-length", "1024",
    )
    yield running
    assert stop_server(running) == 0, running.log()


def test_every_rpc(client):
    info = client.model_info()
    assert info.engine == "llama.cpp" and info.context_length == 1024 and info.has_chat_template
    assert info.limits is not None and info.limits.max_batch_size == 8
    assert "json_schema" in info.constraint_kinds and "temperature" in info.samplers

    status = client.status()
    assert status.max_batch_size == 8 and not status.draining

    tokens = client.tokenize("Hello world")
    assert tokens.count == len(tokens.token_ids) == len(tokens.pieces) >= 2
    assert b"".join(tokens.pieces).endswith(b"Hello world")
    chat_tokens = client.tokenize(messages=[{"role": "user", "content": "Hello world"}])
    assert chat_tokens.count > tokens.count  # the chat template adds its turn markers

    compiled = client.compile(regex="[a-z]{3,8}")
    assert compiled.warnings == [] and client.compile(Constraint(regex="[a-z]{3,8}")).cached

    generation = client.generate("The capital of France is", max_new_tokens=6, temperature=0)
    assert generation.finish is not None and generation.finish.reason in {"max_tokens", "eos_token"}
    assert generation.generated_tokens == generation.finish.usage.completion_tokens <= 6
    assert generation.text and generation.request_id

    with client.stream("The capital of France is", max_new_tokens=6, temperature=0) as stream:
        chunks = list(stream)
    assert "".join(c.text for c in chunks) == stream.text == generation.text  # greedy: the same text
    assert chunks[-1].finish is not None and all(c.finish is None for c in chunks[:-1])
    assert chunks[0].input_tokens > 0 and stream.finish == chunks[-1].finish

    unknown = f"never-started-{uuid.uuid4()}"
    assert client.cancel(unknown).not_found == [unknown]


def test_every_request_field_reaches_the_server(client):
    """Dataclasses for sampling, stopping and output, and chat messages, reach the engine."""
    generation = client.generate(
        messages=[tokenspout.Message("system", "Answer briefly."), {"role": "user", "content": "Count: one two"}],
        sampling=Sampling(temperature=0.7, top_k=20, seed=1234, repetition_penalty=1.1,
                          dry=tokenspout.Dry(multiplier=0.8)),
        stopping=Stopping(max_new_tokens=5, ignore_eos=True),
        output=Output(return_token_ids=True, return_logprobs=True, top_logprobs=2),
    )
    assert generation.finish.reason == "max_tokens" and generation.finish.seed == 1234
    assert len(generation.tokens) == 5
    assert all(t.logprob is not None and len(t.top_logprobs) == 2 for t in generation.tokens)
    stopped = client.generate("1, 2, 3, 4, 5, 6,", temperature=0, max_new_tokens=40, stop=[" 9"])
    assert stopped.finish.reason == "stop_sequence" and stopped.finish.stop_sequence == " 9"
    assert stopped.text.endswith("8,")


def test_json_schema_stream_through_a_pydantic_model(client):
    prompt = [{"role": "user", "content": "Describe a person called Ada as JSON."}]
    with client.stream(messages=prompt, json_schema=Person, temperature=0, max_new_tokens=64) as stream:
        generation = stream.result()
    person = generation.parse(Person)
    assert isinstance(person, Person) and person.name
    assert generation.finish.reason == "constraint_complete" and generation.finish.constraint_satisfied
    as_dict = client.generate(messages=prompt, json_schema=Person.model_json_schema(), temperature=0,
                              max_new_tokens=64)
    assert as_dict.text == generation.text


def test_leaving_the_stream_block_cancels_the_rpc(client):
    request_id = f"leave-{uuid.uuid4()}"
    before = client.status().cancelled_total
    with client.stream("Once upon a time", request_id=request_id,
                       stopping=Stopping(max_new_tokens=900, ignore_eos=True)) as stream:
        first = [next(stream) for _ in range(3)]
    assert first[0].request_id == request_id and stream.finish is None
    # The server saw the cancellation and freed the request (it no longer knows the id).
    wait_for(lambda: client.status().cancelled_total > before, what="the server to count the cancellation")
    assert client.cancel(request_id).not_found == [request_id]
    with pytest.raises(tokenspout.CancelledError):
        next(stream)


def test_a_deadline_ends_the_call(client):
    slow = dict(stopping=Stopping(max_new_tokens=900, ignore_eos=True))
    with pytest.raises(tokenspout.DeadlineExceededError):
        with client.stream("Once upon a time", timeout=2.0, **slow) as stream:
            for _ in stream:
                pass
    assert stream.retries == 0 and stream.text  # it streamed until the deadline, and was never retried
    with pytest.raises(tokenspout.DeadlineExceededError):
        client.generate("Once upon a time", timeout=0.5, **slow)


def test_invalid_argument_is_decoded_into_field_violations(client):
    with pytest.raises(tokenspout.InvalidRequestError) as caught:
        client.generate("Hi", sampling=Sampling(temperature=-1.0, top_p=5.0))
    error = caught.value
    assert error.reason == "INVALID_REQUEST" and error.code.name == "INVALID_ARGUMENT"
    fields = {violation.field for violation in error.field_violations}
    assert {"sampling.temperature", "sampling.top_p"} <= fields
    with pytest.raises(tokenspout.InvalidRequestError) as bad_regex:
        client.compile(regex="(unclosed")
    assert bad_regex.value.field_violations and bad_regex.value.field_violations[0].field.startswith("constraint")
    with pytest.raises(tokenspout.NotFoundError) as unknown_model:
        client.model_info(model="no-such-model")
    assert unknown_model.value.reason == "MODEL_NOT_FOUND"
    with pytest.raises(ValueError):
        client.generate("Hi", regex="a", json_schema={"type": "string"})  # one constraint only


def test_overload_is_decoded_and_retried_after_its_delay(full_server, caplog):
    address = full_server.address
    with Client(address, timeout=120) as client:
        before = client.status().rejected_total
        busy = client.stream("Once upon a time", stopping=Stopping(max_new_tokens=900, ignore_eos=True))
        with busy:
            next(busy)  # the one slot is taken
            with pytest.raises(tokenspout.OverloadedError) as refused:
                Client(address, retry=0).generate("Hi", max_new_tokens=2)
            assert refused.value.reason == "OVERLOADED" and refused.value.retry_after == pytest.approx(1.0)

            outcome: dict = {}

            def retrying_stream() -> None:
                patient = Client(address, retry=RetryPolicy(max_retries=5), timeout=60)
                with patient.stream("Hi", max_new_tokens=3, temperature=0) as stream:
                    outcome["generation"] = stream.result()
                    outcome["retries"] = stream.retries

            caplog.set_level(logging.INFO, logger="tokenspout.client")
            worker = threading.Thread(target=retrying_stream)
            worker.start()
            wait_for(lambda: client.status().rejected_total >= before + 2, what="the retrying stream's refusal")
        # Leaving the block freed the slot; the retry after the server's delay gets it.
        worker.join(timeout=60)
    assert outcome["retries"] >= 1 and outcome["generation"].finish.reason in {"max_tokens", "eos_token"}
    waits = [float(m) for m in re.findall(r"retrying the stream in ([\d.]+) s after RESOURCE_EXHAUSTED", caplog.text)]
    assert waits and min(waits) >= 1.0  # RetryInfo's delay, not the shorter default backoff


def test_round_robin_spreads_calls_over_several_servers(server, full_server):
    with Client([server.address, full_server.address]) as client:
        # round_robin uses the servers as their connections become ready; pick_first never would.
        batch_sizes = wait_for(
            lambda: {client.status().max_batch_size for _ in range(4)} == {8, 1} and {8, 1},
            what="calls to reach both servers",
        )
    assert batch_sizes == {8, 1}


def test_round_robin_sends_no_new_call_to_a_draining_server(tmp_path, model_path):
    """Client health checking: a replica that is draining (NOT_SERVING, still listening) gets nothing new."""
    draining, staying = (start_server(tmp_path, "--max-batch-size", str(n), "--context-length", "1024",
                                      "--grace-period-s", "60") for n in (1, 2))
    try:
        with Client([draining.address, staying.address], timeout=30) as client:
            wait_for(lambda: {client.status().max_batch_size for _ in range(4)} == {1, 2}, what="both servers")
            with Client(draining.address, timeout=60) as direct, direct.stream(
                "Count:", max_new_tokens=1000, ignore_eos=True
            ) as long_stream:
                # Keeps the draining server open (several seconds of tokens: 240 once ended before
                # the checks below did); leaving this block cancels it.
                next(long_stream)
                draining.process.send_signal(signal.SIGTERM)
                draining.wait_until_draining()
                # Once the health watch has reported NOT_SERVING, nothing new goes there.
                wait_for(lambda: all(client.status().max_batch_size == 2 for _ in range(4)),
                         what="the draining server to leave the rotation")
                sizes = [client.status().max_batch_size for _ in range(12)]
                assert sizes == [2] * 12, sizes
                assert draining.process.poll() is None, "the draining server was still listening"
    finally:
        for running in (draining, staying):
            stop_server(running)


def test_api_key_and_unauthenticated(tmp_path, monkeypatch, model_path):
    key = f"sk-{uuid.uuid4().hex}"
    digest = hashlib.sha256(key.encode()).hexdigest()
    running = start_server(tmp_path, "--max-batch-size", "1", "--context-length", "256",
                           env={"TOKENSPOUT_API_KEYS": f"ci:{digest}"})
    try:
        with Client(running.address, api_key=key, timeout=30) as client:
            assert client.generate("Hi", max_new_tokens=2).generated_tokens >= 1
        for wrong in (None, "sk-not-this-one"):
            monkeypatch.delenv("TOKENSPOUT_API_KEY", raising=False)
            with Client(running.address, api_key=wrong, timeout=30) as client:
                with pytest.raises(tokenspout.UnauthenticatedError) as refused:
                    with client.stream("Hi", max_new_tokens=2) as stream:
                        next(stream)
            assert refused.value.reason == "UNAUTHENTICATED" and stream.retries == 0
        monkeypatch.setenv("TOKENSPOUT_API_KEY", key)  # the default when api_key is not given
        with Client(running.address, timeout=30) as client:
            assert client.status().max_batch_size == 1
        refused_cli = run_cli("--address", running.address, "--api-key", "sk-wrong", "info")
        assert refused_cli.returncode == 1 and "UNAUTHENTICATED" in refused_cli.stderr
    finally:
        stop_server(running)


def test_tls_and_mutual_tls(tmp_path, model_path):
    from tests.service.test_tls import make_cert

    ca = make_cert(tmp_path, "test-ca")
    server_key, server_cert = make_cert(tmp_path, "server", ca)
    client_key, client_cert = make_cert(tmp_path, "client", ca)
    running = start_server(
        tmp_path, "--tls-cert", str(server_cert), "--tls-key", str(server_key), "--tls-client-ca", str(ca[1]),
        "--max-batch-size", "1", "--context-length", "256",
    )
    try:
        tls = tokenspout.Tls(ca[1].read_bytes(), client_key.read_bytes(), client_cert.read_bytes(), "localhost")
        with Client(running.address, tls=tls, timeout=30) as client:
            assert client.generate("Hi", max_new_tokens=2).generated_tokens >= 1
        with Client(running.address, tls=tokenspout.Tls(ca[1].read_bytes()), timeout=10, retry=0) as client:
            with pytest.raises(tokenspout.UnavailableError):
                client.status()
    finally:
        stop_server(running)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenspout", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_cli(server):
    address = ["--address", server.address]
    info = json.loads(run_cli(*address, "--json", "info").stdout)
    assert info["model"]["engine"] == "llama.cpp" and info["status"]["max_batch_size"] == 8

    streamed = run_cli(*address, "stream", "The capital of France is", "--max-new-tokens", "6",
                       "--temperature", "0")
    generated = json.loads(run_cli(*address, "--json", "generate", "The capital of France is",
                                   "--max-new-tokens", "6", "--temperature", "0").stdout)
    assert streamed.returncode == 0 and streamed.stdout.strip() == generated["text"].strip()
    lines = run_cli(*address, "--json", "stream", "Hi", "--max-new-tokens", "4", "--chat").stdout.splitlines()
    assert json.loads(lines[-1])["finish"]["reason"] in {"max_tokens", "eos_token"}

    tokens = json.loads(run_cli(*address, "--json", "tokenize", "Hello world").stdout)
    assert tokens["count"] == len(tokens["token_ids"]) >= 2

    refused = run_cli(*address, "generate", "Hi", "--temperature", "-1")
    assert refused.returncode == 1 and "sampling.temperature" in refused.stderr


def test_cli_json_goes_before_or_after_the_command_and_a_missing_file_is_one_line(server, tmp_path):
    """`--json` after `generate` was read as an abbreviation of `--json-schema` (exit 2); an unreadable @file
    ended in a traceback."""
    schema = tmp_path / "city.schema.json"
    schema.write_text('{"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, '
                      '"required": ["city"], "additionalProperties": false}')
    address = ["--address", server.address]
    after = run_cli(*address, "generate", "--chat", "A city", "--json-schema", f"@{schema}", "--temperature", "0",
                    "--json")
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout)["finish"]["reason"] == "constraint_complete"
    before = run_cli(*address, "--json", "tokenize", "Hello world")
    assert before.returncode == 0 and json.loads(before.stdout)["count"] == 2
    assert json.loads(run_cli(*address, "tokenize", "Hello world", "--json").stdout) == json.loads(before.stdout)
    missing = run_cli(*address, "generate", "Hi", "--json-schema", f"@{tmp_path / 'nope.json'}")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().endswith(f"error: cannot read {tmp_path / 'nope.json'}: No such file or directory")
    no_ca = run_cli(*address, "--ca", str(tmp_path / "nope.pem"), "info")
    assert no_ca.returncode == 2 and "cannot read" in no_ca.stderr and "Traceback" not in no_ca.stderr
    abbreviated = run_cli(*address, "generate", "Hi", "--json-sch", "{}")
    assert abbreviated.returncode == 2 and "unrecognized arguments: --json-sch" in abbreviated.stderr
