"""Shared fixtures, in two lanes.

Tests marked `model` need the real embedded model: they ask for `model` (loaded in this process),
`model_path`, or `server` / `channel` / `stub` (a real server serving it), and the mark follows from
that (pytest_collection_modifyitems). Every other test needs no model: the service's tests run on
tests/harness/fake_engine.py, in process (`fake_server`, `fake_channel`, `fake_stub`, harness.inprocess_server.start_fake)
or as a real `tokenspout serve` process where signals and exit codes matter
(start_server(..., fake_engine=True)). `make test-fast` runs that lane alone (`-m "not model"`),
and there anything that would load the model fails, naming the fixture to ask for.
"""

from __future__ import annotations

import os
import pathlib
import shutil
from collections.abc import Iterator

import grpc
import pytest

from tests.harness import servers
from tests.harness.inprocess_server import InProcessServer, start_fake
from tests.harness.servers import REPORT, SERVER_CONTEXT_LENGTH, RunningServer, refuse_in_the_fast_lane, start_server, stop_server
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

if shutil.which("nvidia-smi") is None:
    # Without a GPU, tokenspout's Triton paged-attention kernel runs in Triton's interpreter on CPU
    # tensors; Triton reads this when a kernel is defined, so before any test imports one.
    os.environ.setdefault("TRITON_INTERPRET", "1")

MODEL_FIXTURES = frozenset({"model", "model_path", "server"})
"""Asking for one of these (directly or through another fixture) marks a test `model`."""


def pytest_configure(config) -> None:
    pin_worker_to_its_cores()
    servers.FAST_LANE = "not model" in (config.getoption("markexpr") or "")
    if servers.FAST_LANE:
        refuse_the_embedded_model()


def refuse_the_embedded_model() -> None:
    """Fails a test that reaches for the model in the real cache; one with a stand-in cache of its own
    (tests/backend/test_default_model.py) fetches and hashes its stand-in."""
    from backend.common import models

    real_cache, fetch = models.cache_dir(), models.default_model_path

    def default_model_path() -> pathlib.Path:
        if models.cache_dir() == real_cache:
            refuse_in_the_fast_lane("loads the embedded model")
        return fetch()

    models.default_model_path = default_model_path


def pin_worker_to_its_cores() -> None:
    """Under pytest-xdist (`make test` runs two workers), each worker keeps to its own share of the CPUs, and so do the
    servers its tests start, which size their llama.cpp threads to it: two tests computing at once never have more
    threads than cores (unpinned, four workers took 29 minutes against 31 in one; threads spinning for cores another
    process held, most likely)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cpus = sorted(os.sched_getaffinity(0))
    if worker is None or count > len(cpus):
        return
    os.sched_setaffinity(0, cpus[int(worker.removeprefix("gw")) :: count])  # every CPU in some worker's share


SLOWEST_FIRST = (
    "tests/bench/test_smoke.py", "tests/deploy/test_affinity.py", "tests/bench/test_gpu_check.py",
    "tests/backend/constraints/test_constrained_generation.py", "tests/backend/llamacpp/test_speculation.py",
    "tests/test_docs_examples.py", "tests/backend/llamacpp/test_prefix_cache.py", "tests/service/test_tool_calls.py",
    "tests/clients/test_clients_generated.py", "tests/backend/llamacpp/test_cache_events.py",
    "tests/service/test_cache_events.py", "tests/deploy/test_deploy.py",
)
"""The files that take longest in a fresh clone (--durations; the generated clients build there, checkov starts
cold), run first: two workers then finish about together rather than one waiting for the other's last long file. A
file missing here only costs time."""


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
    rank = {path: index for index, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session")
def model_path() -> pathlib.Path:
    """The embedded model's file (fetched once): tests that start servers on it ask for this."""
    from backend.common.models import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def model(model_path: pathlib.Path):
    """The embedded model loaded in this process (read-only: tests share it)."""
    from backend.llamacpp.model import GgufModel

    loaded = GgufModel(model_path)
    yield loaded
    loaded.close()


def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(
        tmp_path_factory.mktemp("server"), "--context-length", str(SERVER_CONTEXT_LENGTH), "--max-batch-size", "8"
    )
    yield running
    assert stop_server(running) == 0, running.log()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, model_path: pathlib.Path) -> Iterator[RunningServer]:
    yield from serving(tmp_path_factory)


@pytest.fixture(scope="module")
def module_server(tmp_path_factory: pytest.TempPathFactory, model_path: pathlib.Path) -> Iterator[RunningServer]:
    """A server like `server`, the module's own: for greedy answers that must follow from the module's requests
    alone, not from what other tests left in a shared cache (a prefix reused to the token can tip a near tie)."""
    yield from serving(tmp_path_factory)


@pytest.fixture(scope="session")
def channel(server: RunningServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        yield ch


@pytest.fixture(scope="session")
def stub(channel: grpc.Channel) -> pb_grpc.GenerationServiceStub:
    return pb_grpc.GenerationServiceStub(channel)


@pytest.fixture(scope="module")
def fake_server() -> Iterator[InProcessServer]:
    """An in-process server on the fake engine, with the settings of `server`."""
    running = start_fake("--context-length", str(SERVER_CONTEXT_LENGTH), "--max-batch-size", "8")
    yield running
    running.close()


@pytest.fixture(scope="module")
def fake_channel(fake_server: InProcessServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(fake_server.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def fake_stub(fake_channel: grpc.Channel) -> pb_grpc.GenerationServiceStub:
    return pb_grpc.GenerationServiceStub(fake_channel)


def pytest_sessionfinish(session) -> None:
    """Under pytest-xdist (`make test` runs it), a worker hands its figures to the controller, which prints them."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["tokenspout_report"] = list(REPORT)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    REPORT.extend(getattr(node, "workeroutput", {}).get("tokenspout_report", []))


def pytest_terminal_summary(terminalreporter) -> None:
    if REPORT:
        terminalreporter.section("tokenspout measurements")
        for line in REPORT:
            terminalreporter.write_line(line)
