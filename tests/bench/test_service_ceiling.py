"""bench.service_ceiling kept honest: its baseline streams the messages tokenspout streams (the same fields set,
the same batching), and one measuring run of each side reports coherent figures (seconds, a fast pace), as
bench.first_message's calls do against the same two servers."""

from __future__ import annotations

import pathlib

import grpc

from bench import first_message
from bench.common import greedy_request
from bench.service_ceiling import measure, report, start_minimal
from tests.harness.servers import start_server, stop_server
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


def test_the_minimal_server_streams_what_tokenspout_streams_and_a_run_reports_coherent_figures(
    tmp_path: pathlib.Path,
) -> None:
    tokenspout = start_server(tmp_path, faults=("--step-s", str(STEP_S)), fake_engine=True)
    minimal, minimal_address = start_minimal(STEP_S)
    try:
        ours, theirs = stream(tokenspout.address, 5), stream(minimal_address, 5)
        assert ours[-1].generated_tokens == theirs[-1].generated_tokens == 5
        assert sum(len(m.text) for m in ours) == sum(len(m.text) for m in theirs) == 5
        # The same fields on the first and the last message (the request id is echoed when the caller gave one);
        # the baseline's finish carries the reason and usage, not tokenspout's timings and seed.
        for mine, baseline in ((ours[0], theirs[0]), (ours[-1], theirs[-1])):
            (our_fields, our_finish, our_usage), (their_fields, their_finish, their_usage) = fields(mine), fields(baseline)
            assert set(our_fields) - {"request_id"} == set(their_fields) - {"request_id"}
            assert set(their_finish) <= set(our_finish) and their_usage == our_usage

        runs = {side: [measure(address, pid, 4, 10, STEP_S)]
                for side, address, pid in (("tokenspout", tokenspout.address, tokenspout.process.pid),
                                           ("minimal", minimal_address, minimal.pid))}
        for [run] in runs.values():
            assert run["tokens"] == 40 and 4 <= run["messages"] <= 40
            # /proc counts CPU in 10 ms ticks: a short run of the minimal server may show none.
            assert 0 < run["whole_of_ideal"] <= 1.05 and run["server_cpu_s"] >= 0 and run["client_cpu_s"] > 0
        assert report(4, runs).startswith("| 4 | ")

        channels = [grpc.insecure_channel(tokenspout.address), grpc.insecure_channel(minimal_address)]
        latencies = first_message.measure(dict(zip(first_message.SIDES, map(pb_grpc.GenerationServiceStub, channels))), 4)
        assert all(len(values) == 4 and all(0 < s < 5 for s in values) for values in latencies.values())
        assert "added by the service" in first_message.summary(latencies)
        for channel in channels:
            channel.close()
    finally:
        stop_server(tokenspout)
        minimal.terminate()
        minimal.wait(timeout=30)
