"""Constraint compiles never stall other callers, and neither do big inputs.

Large compiles run in their own lane, bounded in number and in how long a caller
waits; the compiled-constraint cache is bounded by estimated memory as well as
count; prompts, chats and Tokenize text have a byte limit.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import grpc
import pytest

from backend.constraints import ConstraintCompiler, ConstraintLimits, ConstraintSpec
from backend.constraints.compiler import estimated_bytes
from tests.harness.helpers import bad_request_fields, error_reason, rpc_error
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc


def big_schema(properties: int, salt: str) -> str:
    """A JSON schema of about 65 bytes a property, distinct per salt (so never a cache hit)."""
    return json.dumps({
        "type": "object",
        "properties": {f"{salt}_{i}": {"type": "string", "pattern": f"^[a-z]{{1,{i % 40 + 1}}}$"} for i in range(properties)},
    })


@pytest.fixture(scope="module")
def gated(tmp_path_factory, model_path):
    server = start_server(
        tmp_path_factory.mktemp("compiles"), "--context-length", "256", "--max-batch-size", "2",
        "--max-concurrent-compiles", "1", "--compile-timeout-s", "0.2", "--max-input-bytes", "4096",
    )
    with grpc.insecure_channel(server.address) as channel:
        yield server, pb_grpc.GenerationServiceStub(channel)
    assert stop_server(server) == 0, server.log()


def compile_call(stub, schema: str):
    return lambda: stub.CompileConstraint(pb.CompileConstraintRequest(constraint=pb.Constraint(json_schema=schema)), timeout=120)


def test_large_compiles_are_bounded_and_small_ones_never_wait_behind_them(gated):
    _, stub = gated
    schemas = [big_schema(3000, "a"), big_schema(3000, "b")]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(rpc_error, compile_call(stub, schema)) for schema in schemas]
        time.sleep(0.05)  # let a large compile start
        # A small constraint compiles and generates meanwhile: it has its own lane.
        request = pb.GenerateRequest(prompt="Call me at ", constraint=pb.Constraint(regex="[0-9]{3}-[0-9]{4}"),
                                     sampling=pb.SamplingParams(temperature=0))
        response = stub.Generate(request, timeout=60)
        assert response.finish.reason == pb.FinishReason.FINISH_REASON_CONSTRAINT_COMPLETE
        errors = [call.result() for call in calls]
    # Whichever large compile came first ran and outlived its caller's 0.2 s budget; the other
    # was refused at once, with advice on when to retry.
    reasons = [error_reason(error) for error in errors]
    assert sorted(reasons) == ["COMPILE_BUDGET_EXCEEDED", "TOO_MANY_COMPILES"]
    assert all(error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for error in errors)
    assert "grpc-retry-pushback-ms" in dict(errors[reasons.index("TOO_MANY_COMPILES")].trailing_metadata())
    # The one that ran finished and was cached, so a retry is instant.
    ran = schemas[reasons.index("COMPILE_BUDGET_EXCEEDED")]
    for _ in range(600):
        try:
            reply = compile_call(stub, ran)()
            break
        except grpc.RpcError as error:
            assert error_reason(error) in ("COMPILE_BUDGET_EXCEEDED", "TOO_MANY_COMPILES")
            time.sleep(0.1)
    assert reply.cached


def test_inputs_past_the_byte_limit_are_refused(gated):
    _, stub = gated
    big = "é" * 2500  # 5,000 UTF-8 bytes, 2,500 characters
    cases = {
        "prompt": lambda: stub.Generate(pb.GenerateRequest(prompt=big), timeout=10),
        "chat": lambda: stub.Generate(
            pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=big)])), timeout=10),
        "text": lambda: stub.Tokenize(pb.TokenizeRequest(text=big), timeout=10),
    }
    for field, call in cases.items():
        error = rpc_error(call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert "at most 4096" in bad_request_fields(error)[field]
    assert stub.Tokenize(pb.TokenizeRequest(text="é" * 2000), timeout=10).count > 0  # 4,000 bytes fit


def test_the_cache_is_bounded_by_estimated_memory(model):
    small = ConstraintSpec("regex", "[0-9]{3}")
    budget = 3 * estimated_bytes(small)
    compiler = ConstraintCompiler(model.constraint_tokenizer(), limits=ConstraintLimits(cache_mb=budget / (1 << 20)))
    specs = [ConstraintSpec("regex", f"[0-9]{{{n}}}") for n in range(1, 7)]
    for spec in specs:
        compiler.compile(spec)
        assert compiler.cached_bytes <= budget
    assert [compiler.cached(spec) is not None for spec in specs] == [False, False, False, True, True, True]
    huge = ConstraintSpec("json_schema", big_schema(200, "c"))
    assert estimated_bytes(huge) > budget
    compiler.compile(huge)  # usable, but never cached past the budget
    assert compiler.cached(huge) is None and compiler.cached_bytes <= budget
