"""bench.suite.service_ceiling kept honest: its baseline streams the messages tokenspout streams (the same fields set,
the same batching), and one measuring run of each side reports coherent figures (seconds, a fast pace).
bench.suite.grpc_overhead times first messages against the same two servers (its smoke run: tests/bench/test_smoke.py)."""

from __future__ import annotations

import grpc

from bench.harness.ceiling_client import measured
from bench.harness.sides import Sides
from bench.harness.streams import greedy_request
from bench.suite.service_ceiling import _row
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

STEP_S = 0.005


def fields(message) -> tuple[list[str], list[str], list[str]]:  # type: ignore[no-untyped-def]
    """The fields a message sets, and those its finish and usage set."""
    finish = message.finish
    return ([f.name for f, _ in message.ListFields()], [f.name for f, _ in finish.ListFields() if f.name != "timings"],
            [f.name for f, _ in finish.usage.ListFields()])


def stream(address: str, tokens: int) -> list:  # type: ignore[type-arg]
    with grpc.insecure_channel(address) as channel:
        return list(pb_grpc.GenerationServiceStub(channel).GenerateStream(greedy_request("Cats are", tokens), timeout=60))


def test_the_minimal_server_streams_what_tokenspout_streams_and_a_run_reports_coherent_figures() -> None:
    with Sides() as sides:
        tokenspout = sides.tokenspout("--max-batch-size", "8", fake_engine=True, faults=("--step-s", str(STEP_S)))
        minimal_pid, minimal_address = sides.minimal_server(STEP_S)
        ours, theirs = stream(tokenspout.address, 5), stream(minimal_address, 5)
        assert ours[-1].generated_tokens == theirs[-1].generated_tokens == 5
        assert sum(len(m.text) for m in ours) == sum(len(m.text) for m in theirs) == 5
        # The same fields on the first and the last message (the request id is echoed when the caller gave one);
        # the baseline's finish carries the reason and usage, not tokenspout's timings and seed.
        for mine, baseline in ((ours[0], theirs[0]), (ours[-1], theirs[-1])):
            (our_fields, our_finish, our_usage), (their_fields, their_finish, their_usage) = fields(mine), fields(baseline)
            assert set(our_fields) - {"request_id"} == set(their_fields) - {"request_id"}
            assert set(their_finish) <= set(our_finish) and their_usage == our_usage

        runs = {side: [measured(address, pid, 4, 10, STEP_S)]
                for side, address, pid in (("split", tokenspout.address, tokenspout.pid),
                                           ("minimal", minimal_address, minimal_pid))}
        for [run] in runs.values():
            assert run["tokens"] == 40 and 4 <= run["messages"] <= 40
            # /proc counts CPU in 10 ms ticks: a short run of the minimal server may show none.
            assert 0 < run["whole_of_ideal"] <= 1.05 and run["server_cpu_s"] >= 0 and run["client_cpu_s"] > 0
        row = _row(4, "split", runs)
        assert row[:2] == [4, "split"] and all(cell != "-" for cell in row[3:5])

