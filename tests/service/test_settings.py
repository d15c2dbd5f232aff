"""Typed settings: every bool through flag, environment and TOML; contradictions refused in one line;
the port checked before the model loads."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time

import grpc
import pytest

from service.cli import _parser, main
from service.config import SETTINGS, load_config, value_of
from tests.harness.servers import ROOT, start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

BOOLS = [name for name, setting in SETTINGS.items() if setting.kind is bool]
# reflection_requires_auth is only allowed with keys; every case carries one.
WITH_A_KEY = {"TOKENSPOUT_API_KEYS": "ops:" + "ab" * 32}
WORDS = [("true", True), ("false", False), ("1", True), ("0", False), ("yes", True), ("no", False),
         ("TRUE", True), ("No", False)]


def from_flags(*argv: str, environ=WITH_A_KEY):
    args = _parser().parse_args(["serve", *argv])
    return load_config(vars(args), environ=environ, config_file=args.config)


def test_the_bool_settings_are_found():
    assert {"trace_content", "reflection_requires_auth", "special_tokens_in_chat_content"} <= set(BOOLS)


@pytest.mark.parametrize("name", BOOLS)
@pytest.mark.parametrize("word, expected", WORDS)
def test_bool_settings_from_every_source(name, word, expected, tmp_path):
    flag = "--" + name.replace("_", "-")
    assert value_of(from_flags(flag, word), name) is expected
    assert value_of(load_config({}, environ={**WITH_A_KEY, f"TOKENSPOUT_{name.upper()}": word}), name) is expected
    quoted = tmp_path / "quoted.toml"  # TOML has booleans: text in their place is refused, not read
    quoted.write_text(f'{name} = "{word}"\n')
    with pytest.raises(ValueError, match=f"{name} must be true or false, not the text '{word}' "
                                         f"\\(write {name} = {str(expected).lower()}, without quotes\\)"):
        load_config({}, environ=WITH_A_KEY, config_file=str(quoted))
    native = tmp_path / "native.toml"
    native.write_text(f"{name} = {str(expected).lower()}\n")
    assert value_of(load_config({}, environ=WITH_A_KEY, config_file=str(native)), name) is expected


@pytest.mark.parametrize("name", BOOLS)
def test_a_bare_bool_flag_means_true_and_flags_win(name, tmp_path):
    flag = "--" + name.replace("_", "-")
    assert value_of(from_flags(flag), name) is True
    config_file = tmp_path / "c.toml"
    config_file.write_text(f"{name} = true\n")
    environ = {**WITH_A_KEY, f"TOKENSPOUT_{name.upper()}": "yes"}
    assert value_of(from_flags("--config", str(config_file), flag, "false", environ=environ), name) is False
    assert value_of(load_config({}, environ={**environ, f"TOKENSPOUT_{name.upper()}": "no"},
                                config_file=str(config_file)), name) is False


@pytest.mark.parametrize("name", BOOLS)
@pytest.mark.parametrize("word", ["maybe", "2", "", "on", "ture"])
def test_anything_else_is_a_one_line_error(name, word, capsys, monkeypatch, tmp_path):
    for key, value in WITH_A_KEY.items():
        monkeypatch.setenv(key, value)
    assert main(["serve", "--" + name.replace("_", "-"), word]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and name in error and "Traceback" not in error
    monkeypatch.setenv(f"TOKENSPOUT_{name.upper()}", word)
    assert main(["serve"]) == 2
    assert name in capsys.readouterr().err
    with pytest.raises(ValueError, match=name):
        (tmp_path / "c.toml").write_text(f"{name} = 1\n")  # TOML has real booleans: a number is not one
        load_config({}, environ=WITH_A_KEY, config_file=str(tmp_path / "c.toml"))


@pytest.mark.parametrize(
    "toml, message",
    [
        ("max_batch_size = 2.5", "max_batch_size: expected an integer"),
        # A quoted number is text, refused as type-checking loaders refuse it (a flag or variable is text anyway).
        ('max_batch_size = "2"', "max_batch_size must be an integer, not the text '2' "
                                 r"\(write max_batch_size = 2, without quotes\)$"),
        ('max_batch_size = "two"', "max_batch_size must be an integer, not the text 'two'$"),
        ('grace_period_s = "5"', r"grace_period_s must be a number, not the text '5' \(write grace_period_s = 5,"),
        ('prefix_cache = "yes"', r"prefix_cache must be true or false, not the text 'yes' \(write prefix_cache = true,"),
        ("listen = 50051", "listen: expected text"),
        ("grace_period_s = 5", None),
        ('cache_type = "q8"', None),  # a closed set's values are text in TOML too
        ('gpu_split = "20,24"', None),
        ("gpu_split = [20, 24.5]", None),
        ('priority_callers = ["a", "b, c"]', None),
        ("threads = true", "threads: expected an integer"),
        ("context_length = [", "not valid TOML"),
    ],
)
def test_toml_values_keep_their_types(toml, message, tmp_path):
    config_file = tmp_path / "c.toml"
    config_file.write_text(toml + "\n")
    if message is None:
        load_config({}, environ={}, config_file=str(config_file))
    else:
        with pytest.raises(ValueError, match=message):
            load_config({}, environ={}, config_file=str(config_file))


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"tls_client_ca": "ca.pem"}, "tls_client_ca .* needs tls_cert"),
        ({"tls_key": "k.pem"}, "tls_cert and tls_key go together"),
        ({"tls_cert": "/nonexistent/c.pem", "tls_key": "/nonexistent/k.pem"}, "tls_cert: cannot read"),
        ({"api_keys_file": "/nonexistent/keys"}, "api_keys_file: cannot read"),
        ({"api_keys": "ops:1234"}, "api_keys line 1: expected name:sha256hex"),
        ({"reflection_requires_auth": "true"}, "reflection_requires_auth needs api_keys"),
        ({"grace_period_s": "-1"}, "grace_period_s"),
        ({"log_level": "LOUD"}, "log_level"),
        ({"listen": "50051"}, "listen must be host:port"),
        ({"prometheus_port": "70000"}, "prometheus_port"),
    ],
)
def test_contradictions_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        load_config(flags, environ={})


def test_mtls_without_a_certificate_never_starts_plaintext(capsys):
    assert main(["serve", "--tls-client-ca", str(ROOT / "pyproject.toml")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "needs tls_cert" in error


def test_a_busy_port_is_one_line_before_the_model_loads(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # The model does not exist: only a port check that comes first can produce this error.
        result = subprocess.run(
            [sys.executable, "-m", "service.cli", "serve", "--listen", f"127.0.0.1:{port}",
             "--model", str(tmp_path / "never-loaded.gguf")],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"tokenspout: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    assert "Traceback" not in result.stderr and "never-loaded" not in result.stderr
    assert "add_port" not in result.stderr  # gRPC never got to log its own error


def traced_rpc_span(tmp_path, *flags: str, env: dict[str, str] | None = None):
    """Starts a server exporting to a stand-in collector, runs one chat and returns its RPC span."""
    from tests.harness.otlp_collector import start_collector

    collector, receiver, port = start_collector()
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100"}
    server = start_server(tmp_path, "--max-batch-size", "1", "--context-length", "256", *flags, env={**otel, **(env or {})},
                          fake_engine=True)
    try:
        request = pb.GenerateStreamRequest(
            chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="Say hi")]),
            sampling=pb.SamplingParams(temperature=0), stopping=pb.StoppingCriteria(max_new_tokens=3),
        )
        with grpc.insecure_channel(server.address) as channel:
            list(pb_grpc.GenerationServiceStub(channel).GenerateStream(request, timeout=60))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            spans = [s for s in collector.spans if s.name == "/tokenspout.v1.GenerationService/GenerateStream"]
            if spans:
                return {a.key for a in spans[0].attributes}
            time.sleep(0.1)
        raise AssertionError("no RPC span arrived")
    finally:
        assert stop_server(server) == 0
        receiver.stop(None)


def test_trace_content_false_really_is_off_on_the_server(tmp_path):
    # `--trace-content false` used to turn the opt-in ON (bool("false")); the flag also beats the environment.
    attributes = traced_rpc_span(tmp_path, "--trace-content", "false", env={"TOKENSPOUT_TRACE_CONTENT": "true"})
    assert "gen_ai.request.model" in attributes and "gen_ai.input.messages" not in attributes
    config_file = tmp_path / "on.toml"
    config_file.write_text('trace_content = true\n')
    attributes = traced_rpc_span(tmp_path, "--config", str(config_file))
    assert {"gen_ai.input.messages", "gen_ai.output.messages"} <= attributes


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_unusable_tls_files_are_refused_before_grpc_sees_them(tmp_path):
    from tests.service.test_tls import make_cert

    ca = make_cert(tmp_path, "ca")
    key, cert = make_cert(tmp_path, "server", ca)
    other_key, _ = make_cert(tmp_path, "other", ca)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    good = {"tls_cert": str(cert), "tls_key": str(key)}
    load_config({**good, "tls_client_ca": str(ca[1])}, environ={})
    for flags, message in (
        ({**good, "tls_key": str(other_key)}, "tls_cert and tls_key: not a PEM certificate and its unencrypted"),
        ({**good, "tls_cert": str(garbage)}, "tls_cert and tls_key"),
        ({**good, "tls_client_ca": str(garbage)}, "tls_client_ca: not a PEM CA certificate"),
    ):
        with pytest.raises(ValueError, match=message):
            load_config(flags, environ={})
