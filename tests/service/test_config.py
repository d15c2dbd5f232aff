"""Settings: flags over environment over config file over defaults."""

import importlib.util

import pytest

from service.cli import main
from service.config import ServeConfig, load_config

ANY_PORT = ("--listen", "127.0.0.1:0")  # the port is bound before the model loads: never a busy default


def test_defaults():
    assert load_config({}, environ={}) == ServeConfig()


def test_precedence_flags_env_file(tmp_path):
    config_file = tmp_path / "tokenspout.toml"
    config_file.write_text('listen = "0.0.0.0:7000"\ncontext_length = 4096\nthreads = 3\nmax_batch_size = 4\n')
    environ = {"TOKENSPOUT_CONTEXT_LENGTH": "1024", "TOKENSPOUT_THREADS": "2"}
    config = load_config({"threads": 1, "model": None}, environ=environ, config_file=str(config_file))
    engine = config.engine
    assert (config.listen, engine.context_length, engine.llamacpp.threads, engine.max_batch_size) == ("0.0.0.0:7000", 1024, 1, 4)


def test_config_file_from_environment(tmp_path):
    config_file = tmp_path / "c.toml"
    config_file.write_text("max_batch_size = 3\n")
    assert load_config({}, environ={"TOKENSPOUT_CONFIG": str(config_file)}).engine.max_batch_size == 3


@pytest.mark.parametrize(
    "flags, environ, message",
    [
        ({}, {"TOKENSPOUT_CONTEXT_LENGTH": "many"}, "context_length"),
        ({"max_batch_size": 0}, {}, "max_batch_size"),
        ({"tls_cert": "c.pem"}, {}, "tls_key"),
        ({"engine": "vllm"}, {}, "engine"),
        ({"first_token_hold_ms": "-1"}, {}, "first_token_hold_ms"),
        ({}, {"TOKENSPOUT_FIRST_TOKEN_HOLD_MS": "500"}, "first_token_hold_ms"),
    ],
)
def test_bad_settings_are_refused(flags, environ, message):
    with pytest.raises(ValueError, match=message):
        load_config(flags, environ=environ)


def test_unknown_keys_in_the_file_are_refused(tmp_path):
    config_file = tmp_path / "c.toml"
    config_file.write_text("contxt_length = 5\n")
    with pytest.raises(ValueError, match="contxt_length"):
        load_config({}, environ={}, config_file=str(config_file))


def test_cli_reports_bad_settings_without_a_traceback(capsys):
    assert main(["serve", "--max-batch-size", "0"]) == 2
    assert "max_batch_size" in capsys.readouterr().err


def test_the_example_config_file_loads():
    from tests.harness.servers import ROOT

    config = load_config({}, environ={}, config_file=str(ROOT / "deploy" / "tokenspout.toml"))
    assert config.listen == "0.0.0.0:50051" and config.engine.max_batch_size == 8
    gpu = load_config({"model": "/models/x-exl2"}, environ={}, config_file=str(ROOT / "deploy" / "tokenspout-exllamav2.toml"))
    engine = gpu.engine
    assert (engine.kind, engine.exllamav2.cache_type, engine.exllamav2.cache_tokens, engine.model) == (
        "exllamav2", "q8", 32768, "/models/x-exl2")
    exl3 = load_config({"model": "/models/x-exl3"}, environ={},
                       config_file=str(ROOT / "deploy" / "tokenspout-exllamav3.toml")).engine
    assert (exl3.kind, exl3.exllamav3.cache_bits, exl3.exllamav3.cache_tokens, exl3.exllamav3.tensor_parallel) == (
        "exllamav3", 8, 32768, False)


def test_exllamav2_attention_from_flag_environment_and_file(tmp_path):
    from service.cli import _parser

    config_file = tmp_path / "c.toml"
    config_file.write_text('attention = "off"\n')
    assert load_config({}, environ={}).engine.exllamav2.attention == "auto"
    assert load_config({}, environ={}, config_file=str(config_file)).engine.exllamav2.attention == "off"
    environ = {"TOKENSPOUT_ATTENTION": "flash-attn"}
    assert load_config({}, environ=environ, config_file=str(config_file)).engine.exllamav2.attention == "flash-attn"
    flags = vars(_parser().parse_args(["serve", "--attention", "sdpa"]))
    assert load_config(flags, environ=environ, config_file=str(config_file)).engine.exllamav2.attention == "sdpa"
    with pytest.raises(ValueError, match="attention must be auto, flash-attn, sdpa, triton or off"):
        load_config({"attention": "xformers"}, environ={})


def test_a_local_gguf_is_served_under_its_name(tmp_path, model_path):
    import grpc

    from tests.harness.servers import start_server, stop_server
    from tokenspout.v1 import generation_pb2 as pb
    from tokenspout.v1 import generation_pb2_grpc as pb_grpc

    model = tmp_path / "my-model.gguf"
    model.symlink_to(model_path)
    server = start_server(tmp_path, "--model", str(model), "--max-batch-size", "1", "--context-length", "128")
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            assert stub.GetModelInfo(pb.GetModelInfoRequest(model="my-model")).model_id == "my-model"
            assert stub.GetModelInfo(pb.GetModelInfoRequest(model=str(model))).model_id == "my-model"
    finally:
        assert stop_server(server) == 0


def test_a_missing_model_file_is_reported_without_a_traceback(capsys):
    assert main(["serve", *ANY_PORT, "--model", "/nonexistent/model.gguf"]) == 2
    assert "no model file at /nonexistent/model.gguf" in capsys.readouterr().err


def test_exllamav2_wants_a_model_directory(capsys, tmp_path):
    assert main(["serve", *ANY_PORT, "--engine", "exllamav2", "--model", str(tmp_path)]) == 2
    assert "model directory with config.json and tokenizer.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main(["serve", *ANY_PORT, "--engine", "exllamav2", "--model", str(tmp_path)]) == 2
    assert "lacks tokenizer.json" in capsys.readouterr().err


def test_exllamav3_wants_a_model_directory_it_can_load(capsys, tmp_path):
    assert main(["serve", *ANY_PORT, "--engine", "exllamav3", "--model", str(tmp_path)]) == 2
    assert "exllamav3 needs a model directory with config.json and tokenizer.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "exl2", "bits": 4.0}}')
    (tmp_path / "tokenizer.json").write_text("{}")
    assert main(["serve", *ANY_PORT, "--engine", "exllamav3", "--model", str(tmp_path)]) == 2
    assert "exllamav3 cannot load EXL2 weights" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("exllamav3") is not None, reason="exllamav3 is installed here")
def test_exllamav3_missing_is_reported_without_a_traceback(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert main(["serve", *ANY_PORT, "--engine", "exllamav3", "--model", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "pip install 'tokenspout[exllamav3]'" in error and "Traceback" not in error


@pytest.mark.skipif(importlib.util.find_spec("exllamav2") is not None, reason="exllamav2 is installed here")
def test_exllamav2_missing_is_reported_without_a_traceback(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert main(["serve", *ANY_PORT, "--engine", "exllamav2", "--model", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "pip install 'tokenspout[exllamav2]'" in error and "Traceback" not in error


@pytest.mark.parametrize("kind", ["truncated", "text", "directory"])
def test_a_bad_model_file_stops_the_start_in_one_line(kind, tmp_path, model_path):
    import subprocess
    import sys

    from tests.harness.servers import ROOT

    bad = tmp_path / "bad.gguf"
    if kind == "truncated":
        with open(model_path, "rb") as model:
            bad.write_bytes(model.read(3_000_000))
    elif kind == "text":
        bad.write_text("not a model\n")
    else:
        bad.mkdir()
    result = subprocess.run([sys.executable, "-m", "service.cli", "serve", *ANY_PORT, "--model", str(bad)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    ours = [line for line in result.stderr.splitlines() if line.startswith("tokenspout:")]
    assert len(ours) == 1 and str(bad) in ours[0], result.stderr
    assert "Traceback" not in result.stderr and " ERROR " not in result.stderr, result.stderr


@pytest.mark.parametrize("engine_process", ["true", "false"])
def test_a_cache_scope_the_engine_cannot_keep_apart_stops_the_start_in_one_line(engine_process):
    import subprocess
    import sys

    from tests.harness.servers import ROOT

    # The fake engine, as exllamav2 and exllamav3, takes no cache_salt.
    result = subprocess.run([sys.executable, "-m", "tests.harness.faults", "--fake-engine", "serve", *ANY_PORT,
                             "--cache-scope", "caller", "--engine-process", engine_process],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    ours = [line for line in result.stderr.splitlines() if line.startswith("tokenspout:")]
    assert len(ours) == 1 and "cannot keep callers' cached prefixes apart" in ours[0], result.stderr
    assert "Traceback" not in result.stderr, result.stderr
