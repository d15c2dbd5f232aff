"""API keys, caller identities and owned requests, on real `tokenspout serve` processes (on the fake engine,
paced like a small model so that streams outlast the checks) and in process."""

from __future__ import annotations

import concurrent.futures
import hashlib
import shutil
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.harness.helpers import SMALL_WINDOW, error_reason, greedy, rpc_error
from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

FINISH = pb.FinishReason
KEYS = {"alice": "alice-secret-key", "bob": "bob-secret-key", "carol": "carol-secret-key"}
SERVER_FLAGS = ("--max-batch-size", "4", "--context-length", "512")
MODEL_PACE = ("--step-s", "0.01")
HELD = "held-"
"""Requests whose id starts with this hold their slot after one token until cancelled, however slow the test is."""


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer(name: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {KEYS[name]}"),)


def long_request(request_id: str, max_new_tokens: int = 300) -> pb.GenerateStreamRequest:
    request = greedy("The history of the printing press", max_new_tokens=max_new_tokens, ignore_eos=True)
    request.request_id = request_id
    return request


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(f"# name:sha256 of the key\nalice:{digest(KEYS['alice'])}\n\nbob:{digest(KEYS['bob'])}\n")
    return path


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, keys_file):
    """Keys from a file (alice, bob) and from the environment (carol); reflection open (the default)."""
    env = {"TOKENSPOUT_API_KEYS": f"carol:{digest(KEYS['carol'])}"}
    server = start_server(tmp_path_factory.mktemp("keyed"), "--api-keys-file", str(keys_file), *SERVER_FLAGS, env=env,
                          faults=(*MODEL_PACE, "--hold-requests-with-prefix", HELD), fake_engine=True)
    yield server
    assert stop_server(server) == 0, server.log()


@pytest.fixture(scope="module")
def channel(keyed):
    with grpc.insecure_channel(keyed.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.GenerationServiceStub(channel)


def unauthenticated(call) -> grpc.RpcError:
    error = rpc_error(call)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED and error_reason(error) == "UNAUTHENTICATED"
    return error


def test_no_key_wrong_key_and_right_key(keyed, stub):
    request = greedy("Hello", max_new_tokens=3)
    assert "send `authorization: Bearer <key>`" in unauthenticated(lambda: stub.GenerateStream(request, timeout=10)).details()
    for metadata in (
        (("authorization", "Bearer not-a-key"),),
        (("authorization", f"Bearer {KEYS['alice']}x"),),
        (("authorization", f"Basic {KEYS['alice']}"),),
        (("authorization", "Bearer "),),
        (("authorization", digest(KEYS["alice"])),),
    ):
        unauthenticated(lambda metadata=metadata: stub.GenerateStream(request, metadata=metadata, timeout=10))
    for call in (
        lambda: stub.Generate(pb.GenerateRequest(prompt="Hi"), timeout=10),
        lambda: stub.Tokenize(pb.TokenizeRequest(text="Hi"), timeout=10),
        lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10),
        lambda: stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10),
        lambda: stub.Cancel(pb.CancelRequest(request_ids=["x"]), timeout=10),
        lambda: stub.CompileConstraint(pb.CompileConstraintRequest(constraint=pb.Constraint(regex="a+")), timeout=10),
    ):
        unauthenticated(call)
    for name in ("alice", "bob", "carol"):  # carol's key comes from TOKENSPOUT_API_KEYS
        messages = list(stub.GenerateStream(request, metadata=bearer(name), timeout=60))
        assert messages[-1].finish.reason == FINISH.FINISH_REASON_MAX_TOKENS
    log = keyed.log()
    assert "authentication on: 3 API keys; health open, reflection open" in log
    # Refusals are logged, rate-limited: the first of this burst names its peer; no key is ever logged.
    assert "refused 1 unauthenticated call(s), the last from ipv" in log
    assert "not-a-key" not in log and KEYS["alice"] not in log


def test_health_and_reflection_stay_open(channel):
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    assert "tokenspout.v1.GenerationService" in list_services(channel)


def list_services(channel, metadata=()) -> list[str]:
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    (response,) = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=metadata, timeout=10
    )
    return [s.name for s in response.list_services_response.service]


def test_another_callers_cancel_does_nothing(keyed, stub):
    # Unread on a small window, alice's stream pauses and stays running however long the checks take.
    unread = grpc.insecure_channel(keyed.address, options=SMALL_WINDOW)
    alice = pb_grpc.GenerationServiceStub(unread).GenerateStream(
        long_request("shared-id", 120), metadata=bearer("alice"), timeout=120
    )
    first = next(alice)
    response = stub.Cancel(pb.CancelRequest(request_ids=["shared-id"]), metadata=bearer("bob"), timeout=10)
    assert list(response.not_found) == ["shared-id"] and not response.cancelled  # as if it did not exist
    # Bob may use the same id for his own request meanwhile; alice may not use hers twice.
    bobs = stub.GenerateStream(long_request("shared-id", 4), metadata=bearer("bob"), timeout=60)
    error = rpc_error(lambda: stub.GenerateStream(long_request("shared-id", 4), metadata=bearer("alice"), timeout=10))
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    assert list(bobs)[-1].generated_tokens == 4
    rest = list(alice)
    assert rest[-1].finish.reason == FINISH.FINISH_REASON_MAX_TOKENS and rest[-1].generated_tokens == 120
    assert first.request_id == rest[-1].request_id == "shared-id"
    unread.close()


def test_the_owner_cancels_its_own_request(stub):
    call = stub.GenerateStream(long_request(f"{HELD}mine"), metadata=bearer("carol"), timeout=120)
    next(call)
    response = stub.Cancel(pb.CancelRequest(request_ids=[f"{HELD}mine"]), metadata=bearer("carol"), timeout=10)
    assert list(response.cancelled) == [f"{HELD}mine"]
    assert list(call)[-1].finish.reason == FINISH.FINISH_REASON_CANCELLED


def test_the_keys_file_is_reloaded(keyed, keys_file, stub):
    request = greedy("Hello", max_new_tokens=2)
    KEYS["dave"] = "dave-secret-key"
    unauthenticated(lambda: stub.GenerateStream(request, metadata=bearer("dave"), timeout=10))
    original = keys_file.read_text()
    try:
        # SIGHUP: at once. Bob's line is gone, dave's is new.
        keys_file.write_text(f"alice:{digest(KEYS['alice'])}\ndave:{digest(KEYS['dave'])}\n")
        keyed.process.send_signal(signal.SIGHUP)
        assert wait_until_accepted(stub, "dave")
        unauthenticated(lambda: stub.GenerateStream(request, metadata=bearer("bob"), timeout=10))
        # A bad file keeps the keys in force.
        keys_file.write_text("dave has no digest\n")
        keyed.process.send_signal(signal.SIGHUP)
        keyed.wait_for_log("API keys file not reloaded, the previous keys stay in force")
        assert list(stub.GenerateStream(request, metadata=bearer("dave"), timeout=30))[-1].generated_tokens == 2
        # No signal: a changed file is noticed by itself.
        keys_file.write_text(original)
        assert wait_until_accepted(stub, "bob")
    finally:
        keys_file.write_text(original)


def wait_until_accepted(stub, name: str, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stub.GetServerStatus(pb.GetServerStatusRequest(), metadata=bearer(name), timeout=10)
            return True
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            time.sleep(0.1)
    return False


def test_reflection_can_require_a_key(tmp_path, keys_file):
    # Set through the environment, as a deployment would.
    env = {"TOKENSPOUT_REFLECTION_REQUIRES_AUTH": "yes"}
    server = start_server(tmp_path, "--api-keys-file", str(keys_file), *SERVER_FLAGS, env=env, fake_engine=True)
    try:
        with grpc.insecure_channel(server.address) as channel:
            unauthenticated(lambda: list_services(channel))
            assert "tokenspout.v1.GenerationService" in list_services(channel, bearer("alice"))
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        assert "reflection needs a key" in server.log()
    finally:
        assert stop_server(server) == 0


def test_without_keys_auth_is_off_and_says_so(fake_server):
    assert "authentication off: no api_keys or api_keys_file configured" in fake_server.log()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_with_mtls_the_certificate_subject_owns_the_request(tmp_path):
    from tests.service.test_tls import make_cert

    ca = make_cert(tmp_path, "test-ca")
    server_key, server_cert = make_cert(tmp_path, "server", ca)
    clients = {name: make_cert(tmp_path, name, ca) for name in ("team-a", "team-b")}
    server = start_server(
        tmp_path, "--tls-cert", str(server_cert), "--tls-key", str(server_key), "--tls-client-ca", str(ca[1]),
        *SERVER_FLAGS, faults=(*MODEL_PACE, "--hold-requests-with-prefix", HELD), fake_engine=True,
    )

    def stub_for(name: str):
        key, cert = clients[name]
        credentials = grpc.ssl_channel_credentials(ca[1].read_bytes(), key.read_bytes(), cert.read_bytes())
        channel = grpc.secure_channel(server.address, credentials)
        return channel, pb_grpc.GenerationServiceStub(channel)

    try:
        (channel_a, a), (channel_b, b) = stub_for("team-a"), stub_for("team-b")
        with channel_a, channel_b:
            call = a.GenerateStream(long_request("job-1", 60), timeout=120)
            next(call)
            assert list(b.Cancel(pb.CancelRequest(request_ids=["job-1"]), timeout=10).not_found) == ["job-1"]
            with concurrent.futures.ThreadPoolExecutor(1) as pool:  # team-b's own job-1 runs alongside
                b_result = pool.submit(lambda: list(b.GenerateStream(long_request("job-1", 3), timeout=60)))
                assert b_result.result()[-1].generated_tokens == 3
            assert list(call)[-1].generated_tokens == 60
            call = a.GenerateStream(long_request(f"{HELD}job-2"), timeout=120)
            next(call)
            assert list(a.Cancel(pb.CancelRequest(request_ids=[f"{HELD}job-2"]), timeout=10).cancelled) == [f"{HELD}job-2"]
            assert list(call)[-1].finish.reason == FINISH.FINISH_REASON_CANCELLED
        assert "authentication by client certificate (mTLS) only" in server.log()
    finally:
        assert stop_server(server) == 0


def test_a_broken_keys_file_is_reported_once_per_version(tmp_path, monkeypatch, caplog):
    """Every call checks the file (at most once a second): a bad file, or a missing one, logged an error at every
    check until it was fixed. Now each bad version is said once, and the keys in force stay."""
    from service import keys

    monkeypatch.setattr(keys, "_FILE_CHECK_S", 0.0)  # every call checks, as calls a second apart would
    path = tmp_path / "keys"
    path.write_text(f"alice:{digest(KEYS['alice'])}\n")
    store = keys.KeyStore(path=str(path))
    caplog.set_level("INFO", logger=keys.__name__)

    def said(text: str) -> int:
        return sum(text in record.getMessage() for record in caplog.records)

    path.write_text("alice has no digest\n")
    for _ in range(5):
        store.reload_if_changed()
    assert said("API keys file not reloaded") == 1 and store.name_for(KEYS["alice"]) == "alice"
    store.reload_if_changed(force=True)  # SIGHUP: the operator asks, so the answer comes again
    assert said("API keys file not reloaded") == 2
    path.unlink()
    for _ in range(5):
        store.reload_if_changed()
    assert said("API keys file not reloaded") == 3 and said("No such file") == 1
    path.write_text(f"bob:{digest(KEYS['bob'])}\n")
    store.reload_if_changed()
    assert said("API keys reloaded") == 1 and store.name_for(KEYS["bob"]) == "bob"
    assert store.name_for(KEYS["alice"]) is None
