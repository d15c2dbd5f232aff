"""What an exllama model folder says about itself, read from its files without a library: every end id, the
weights' format (GetModelInfo.quantization), whether a plain prompt starts with BOS."""

from __future__ import annotations

import json

from backend.exllama.model_files import adds_bos, end_token_ids, weight_format
from tests.harness.exllama_fakes import safetensors_with


def test_every_end_id_of_config_generation_config_and_tokenizer_is_kept(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert end_token_ids(tmp_path, None) == (2, 7)  # no generation_config.json; a list in config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert end_token_ids(tmp_path, 1) == (1, 2, 7, 9)
    (tmp_path / "config.json").write_text(json.dumps({}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    assert end_token_ids(tmp_path, 5) == (5,)


def test_the_weight_format_comes_from_the_config_or_the_tensor_names(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "exl2", "bits": 4.0}}))
    assert weight_format(tmp_path) == "EXL2 4.0 bpw"
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq", "bits": 4}}))
    assert weight_format(tmp_path) == "GPTQ 4-bit"
    (tmp_path / "config.json").write_text("{}")
    safetensors_with(tmp_path / "model.safetensors", "model.layers.0.mlp.up_proj.weight")
    assert weight_format(tmp_path) == "FP16"
    safetensors_with(tmp_path / "model-2.safetensors", "model.layers.0.mlp.up_proj.qweight")
    assert weight_format(tmp_path) == "GPTQ"
    safetensors_with(tmp_path / "model-2.safetensors", "model.layers.0.mlp.up_proj.q_weight")
    assert weight_format(tmp_path) == "EXL2"
    safetensors_with(tmp_path / "model-2.safetensors", "model.layers.0.mlp.up_proj.trellis")
    assert weight_format(tmp_path) == "EXL3"


def test_exl3_and_bf16_weights_are_named(tmp_path):
    # What exllamav3 1.6.5's converter writes into config.json (conversion/compile.py).
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "exl3", "bits": 4.0,
                                                                              "head_bits": 6}}))
    assert weight_format(tmp_path) == "EXL3 4.0 bpw"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    safetensors_with(tmp_path / "model.safetensors", "model.layers.0.mlp.up_proj.weight", dtype="BF16")
    assert weight_format(tmp_path) == "BF16"
    safetensors_with(tmp_path / "model.safetensors", "model.layers.0.mlp.up_proj.weight", dtype="F16")
    assert weight_format(tmp_path) == "FP16"


def test_bos_follows_the_tokenizer_config_else_the_post_processor(tmp_path):
    assert adds_bos(tmp_path, "<s>") is False  # nothing says so
    llama3 = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|begin_of_text|>"}}, {"Sequence": {"id": "A"}}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"post_processor": {"type": "Sequence", "processors": [
        {"type": "ByteLevel"}, llama3]}}))
    assert adds_bos(tmp_path, "<|begin_of_text|>") is True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    assert adds_bos(tmp_path, "<|begin_of_text|>") is False  # the config's word wins
