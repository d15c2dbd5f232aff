"""bench/gpu/make_random_model.py: the layouts exllamav2 0.3.2 loads, checked without exllamav2 (its
import compiles CUDA). The EXL2 checks redo, in Python, what the extension does with q_groups on the GPU
(exllamav2/exllamav2_ext/cuda/q_matrix.cu:127-159 and ext.py's make_group_map), where a wrong layout
reads out of bounds instead of failing."""

from __future__ import annotations

import json
import math
import pathlib
import struct

import numpy as np
import pytest

from backend.exllama.model_files import tensor_headers, weight_format
from backend.exllamav2.loading import unloadable_weights
from bench.gpu import make_random_model as mrm
from bench.gpu.tiny_llama import gptq_dequantize

SHUFFLE_ROWS = {8: 4, 6: 16, 5: 32, 4: 8, 3: 32, 2: 16}


def exllamav2_rows(q_groups: list[int], num_qrows: int) -> tuple[int, dict[int, int]]:
    """The matrix height and rows per bit width as QMatrix's constructor derives them: a group's rows
    from the packed rows up to the next group's first, the last group's from q_weight's height."""
    height, rows_per_bits = 0, {}
    groups = len(q_groups) // 2
    for i in range(groups):
        bits = q_groups[2 * i]
        end = q_groups[2 * i + 3] if i < groups - 1 else num_qrows
        rows = (end - q_groups[2 * i + 1]) * 32 // bits
        rows_per_bits[bits] = rows_per_bits.get(bits, 0) + rows
        height += rows
    return height, rows_per_bits


def tensors_of(key: str, k: int, n: int, qp) -> dict:
    torch = pytest.importorskip("torch")
    make = mrm.Makers("cpu", 0)
    small = {name.rsplit(".", 1)[1]: (shape, values) for name, _, shape, values in mrm.exl2_linear(key, k, n, qp, 0.02)}
    out = {part: shape for part, (shape, _) in small.items()}
    out["q_groups_values"] = small["q_groups"][1](make).tolist()
    out["q_scale_max_values"] = small["q_scale_max"][1](make).float().tolist()
    assert small["q_groups"][1](make).dtype == torch.int16
    return out


@pytest.mark.parametrize("shape", sorted(mrm.SHAPES))
def test_every_exl2_matrix_has_the_height_and_shapes_the_extension_derives(shape):
    s = mrm.SHAPES[shape]
    layers_6 = mrm.mlp_option_6_layers(s)
    matrices = [(f"l{layer}.{name}", k, n, qp) for layer in (0, s.layers - 1)
                for (name, k, n), qp in zip(mrm.linears(s), mrm.exl2_strategy(s, layer, layers_6))]
    matrices.append(("lm_head", s.hidden, s.vocab, mrm.HEAD_6B))
    for key, k, n, qp in matrices:
        t = tensors_of(key, k, n, qp)
        groups = len(t["q_groups_values"]) // 2
        height, rows_per_bits = exllamav2_rows(t["q_groups_values"], t["q_weight"][0])
        assert height == k, key
        assert all(rows % SHUFFLE_ROWS[bits] == 0 for bits, rows in rows_per_bits.items()), (key, rows_per_bits)
        assert list(rows_per_bits) == sorted(rows_per_bits, reverse=True)  # 8 before 6 before 4 ...
        assert t["q_weight"] == (sum(rows * bits // 32 for bits, rows in rows_per_bits.items()), n)
        assert t["q_scale"] == (groups, n // 8) and n % 8 == 0  # TORCH_CHECK_SHAPES(q_weight, 1, q_scale, 1, 8)
        assert t["q_scale_max"] == (groups,) and t["q_invperm"] == (k,) and k < 32768  # int16 at load
        assert all(0 < m < 0.05 and math.isfinite(m) for m in t["q_scale_max_values"])


def test_the_8b_layouts_have_the_sizes_and_bits_per_weight_of_the_real_formats():
    s = mrm.SHAPES["llama3-8b"]
    sizes = {fmt: mrm.layout(s, fmt) for fmt in mrm.FORMATS}
    assert sizes["fp16"]["bytes"] == 2 * (2 * s.vocab * s.hidden + s.layers * (
        2 * s.hidden + sum(k * n for _, k, n in mrm.linears(s))) + s.hidden)  # every parameter, 2 bytes
    assert round(sizes["fp16"]["bytes"] / 1e9, 2) == 16.06
    assert round(sizes["gptq"]["bytes"] / 1e9, 2) == 5.73
    assert round(sizes["exl2"]["bytes"] / 1e9, 2) == 4.95
    assert 3.9 < sizes["exl2"]["layer_bpw"] <= mrm.TARGET_BPW < sizes["gptq"]["layer_bpw"] < 4.2
    assert 0 < sizes["exl2"]["mlp_option_6_layers"] < s.layers


def test_the_dry_run_prints_the_layout_and_writes_nothing(tmp_path, capsys):
    assert mrm.main([str(tmp_path / "m"), "--format", "exl2", "--dry-run"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["format"] == "exl2" and printed["shape"]["vocab"] == 128256 and printed["tensors"] == 1191
    assert not (tmp_path / "m").exists()


def read_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a file, its header checked against the bytes: offsets contiguous, nothing left over."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header.pop("__metadata__")
    body, arrays, expected = data[8 + length:], {}, 0
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        start, end = entry["data_offsets"]
        assert start == expected, name
        dtype = {"F16": np.float16, "I32": np.int32, "I16": np.int16}[entry["dtype"]]
        arrays[name] = np.frombuffer(body[start:end], dtype=dtype).reshape(entry["shape"])
        expected = end
    assert expected == len(body)
    return arrays


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("random-models")
    text = [pathlib.Path(__file__).resolve().parents[2] / "README.md"]
    for fmt in mrm.FORMATS:
        assert mrm.main([str(root / fmt), "--format", fmt, "--shape", "tiny", "--device", "cpu", "--text", *map(str, text)]) == 0
    return root


def test_the_tiny_models_are_what_the_engine_reads_them_as(tiny_models):
    assert weight_format(tiny_models / "exl2") == "EXL2 4.0 bpw"
    assert weight_format(tiny_models / "gptq") == "GPTQ 4-bit"
    assert weight_format(tiny_models / "fp16") == "FP16"
    for fmt in mrm.FORMATS:
        assert unloadable_weights(tiny_models / fmt) == ""
        config = json.loads((tiny_models / fmt / "config.json").read_text())
        assert config["num_key_value_heads"] == 4 and config["vocab_size"] == 4096
        assert (tiny_models / fmt / "tokenizer.json").exists()
        names = set(tensor_headers(tiny_models / fmt))
        assert {"model.embed_tokens.weight", "model.norm.weight"} <= names
        assert len([n for n in names if n.startswith("model.layers.3.")]) > 7


def test_the_tiny_fp16_and_gptq_weights_have_the_spread_of_the_tiny_model(tiny_models):
    fp16 = read_safetensors(next((tiny_models / "fp16").glob("*.safetensors")))
    weight = fp16["model.layers.0.mlp.down_proj.weight"].astype(np.float32)
    assert weight.shape == (512, 1536) and 0.018 < weight.std() < 0.022
    gptq = read_safetensors(next((tiny_models / "gptq").glob("*.safetensors")))
    parts = {part: gptq[f"model.layers.0.mlp.down_proj.{part}"] for part in ("qweight", "qzeros", "scales", "g_idx")}
    assert (parts["qzeros"].view(np.uint32) == 0x77777777).all()
    assert (parts["g_idx"] == np.arange(1536) // 128).all()
    dequantized = gptq_dequantize(parts)
    assert dequantized.shape == (512, 1536) and np.isfinite(dequantized).all()
    step = float(parts["scales"][0, 0])
    assert 0.018 < dequantized.std() < 0.022 and abs(dequantized.mean() + step / 2) < step / 10  # q - 8 spans -8..7
    assert gptq["lm_head.weight"].dtype == np.float16  # the head stays FP16 in GPTQ


def test_the_tiny_exl2_tensors_are_consistent(tiny_models):
    exl2 = read_safetensors(next((tiny_models / "exl2").glob("*.safetensors")))
    for key in ("model.layers.0.mlp.down_proj", "model.layers.3.mlp.gate_proj", "model.layers.1.self_attn.k_proj", "lm_head"):
        k = exl2[key + ".q_invperm"].shape[0]
        assert sorted(exl2[key + ".q_invperm"].tolist()) == list(range(k))
        height, _ = exllamav2_rows(exl2[key + ".q_groups"].tolist(), exl2[key + ".q_weight"].shape[0])
        assert height == k
        assert np.isfinite(exl2[key + ".q_scale_max"].astype(np.float32)).all()
    assert exl2["model.embed_tokens.weight"].dtype == np.float16 and "lm_head.weight" not in exl2
