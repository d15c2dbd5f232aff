"""A Llama-3-8B-shaped model with random but valid weights, written directly as FP16, GPTQ or EXL2.

No converter, no download: the tensors are written in the layouts exllamav2 0.3.2 loads
(exllamav2/module.py:116-129 picks the format by tensor names; ext.py:330-409 and
exllamav2_ext/ext_qmatrix.cpp:22-115 take them apart), so the GPU check can measure a real-size
model against the memory-bandwidth limit (../shared/research/gpu-real-size.md):

* FP16: Hugging Face names and [out, in] layouts, normal values (std 0.02; embedding 1.0, head 0.05).
* GPTQ 4-bit, group 128, AutoGPTQ v1 layout: qweight [K/8, N] int32 (8 nibbles along K), qzeros
  [K/128, N/8] (zero 8, stored minus one: 0x77777777), scales [K/128, N] fp16, g_idx = k // 128.
  Embedding, norms and head stay FP16, as in real GPTQ checkpoints.
* EXL2 at 4.0 bits per weight, 6-bit head: per linear layer q_weight [sum of rows * bits / 32, N]
  int32, q_scale [groups, N/8] int32 (4-bit scales), q_scale_max [groups] fp16, q_groups [2 * groups]
  int16 (bits, first packed row; groups in row order, bits descending, as AdaptiveGPTQ.pack writes
  them) and q_invperm [K] int32 (a permutation). Bit mixes are exllamav2's own qparams options:
  attention 4-bit g128; MLP options 6 and 7 mixed so the layers average 4.0 bpw; head 15% 8-bit,
  85% 6-bit, g128. exllamav2 rebuilds each matrix's height from q_groups and q_weight's rows
  (q_matrix.cu:127-159): a wrong layout reads out of bounds on the GPU instead of failing, so
  `check_exl2_groups` proves it here first.

Any bit pattern is a valid quantized code, so q_weight and q_scale are random words; scales are set
so every weight has a standard deviation near 0.02 and the logits stay finite.

    python bench/gpu/make_random_model.py OUT_DIR --format exl2|gptq|fp16 [--shape llama3-8b|tiny] [--dry-run]

The tokenizer is tiny_llama's byte-level BPE (4,096 pieces, trained on this repository's docs);
config.json says the shape's vocabulary (128,256), and exllamav2 masks the head's logits past the
tokenizer's (generator/sampler.py:513-517), so the head still computes and reads them all.
Tensors are made on the GPU when there is one, in shards of at most 2 GB written by parallel threads.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import pathlib
import sys
import time
from collections.abc import Callable, Iterator

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu.tiny_llama import model_config, train_tokenizer, write_side_files  # noqa: E402

FORMATS = ("fp16", "gptq", "exl2")
GPTQ_GROUP = 128
SHARD_BYTES = 2 << 30  # 8 FP16 files written at once, 3 EXL2
DTYPE_BYTES = {"F16": 2, "I32": 4, "I16": 2}
SHUFFLE_ROWS = {8: 4, 6: 16, 5: 32, 4: 8, 3: 32, 2: 16}  # rows per shuffled unit, q_matrix.cu:38-43
LINEAR_STD, EMBED_STD, HEAD_STD = 0.02, 1.0, 0.05


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float
    context: int


SHAPES = {
    "llama3-8b": Shape(4096, 14336, 32, 32, 8, 128256, 500000.0, 8192),
    "tiny": Shape(512, 1536, 4, 8, 4, 4096, 10000.0, 2048),  # tiny_llama's shape
}


@dataclasses.dataclass(frozen=True)
class QParams:
    """One exllamav2 quantization option (conversion/qparams.py): bits descending, the share of rows
    at each, and the group size per bits."""

    bits: tuple[int, ...]
    props: tuple[float, ...]
    group_size: tuple[int, ...]


ATTENTION_4B = QParams((4,), (1.0,), (128,))  # qparams_attn[6]
MLP_OPTION_6 = (QParams((4, 3), (0.1, 0.9), (32, 32)), QParams((4, 3), (0.25, 0.75), (32, 32)),
                QParams((8, 4), (0.05, 0.95), (32, 128)))  # qparams_mlp[6]: gate, up, down
MLP_OPTION_7 = (QParams((4,), (1.0,), (128,)), QParams((4,), (1.0,), (32,)),
                QParams((8, 4), (0.05, 0.95), (32, 128)))  # qparams_mlp[7]
HEAD_6B = QParams((8, 6), (0.15, 0.85), (128, 128))  # qparams_headoptions[6]
TARGET_BPW = 4.0

Entry = tuple[str, str, tuple[int, ...], Callable[["Makers"], object]]
"""(tensor name, safetensors dtype, shape, a function making its values as a torch tensor with Makers)."""


def linears(shape: Shape) -> list[tuple[str, int, int]]:
    """(name, in features K, out features N) of one decoder layer's linear layers."""
    kv = shape.kv_heads * (shape.hidden // shape.heads)
    return [("self_attn.q_proj", shape.hidden, shape.hidden), ("self_attn.k_proj", shape.hidden, kv),
            ("self_attn.v_proj", shape.hidden, kv), ("self_attn.o_proj", shape.hidden, shape.hidden),
            ("mlp.gate_proj", shape.hidden, shape.intermediate), ("mlp.up_proj", shape.hidden, shape.intermediate),
            ("mlp.down_proj", shape.intermediate, shape.hidden)]


def exl2_groups(rows: int, qp: QParams) -> list[tuple[int, int]]:
    """(bits, rows) per group in row order, as AdaptiveGPTQ.configure counts them and quantize
    cuts them (conversion/adaptivegptq.py:166-194, 386-394)."""
    counts, left = [], rows
    for prop, size in zip(qp.props, qp.group_size):
        count = math.ceil(min(rows * prop, left) / size)
        counts.append(count)
        left -= count * size
    groups, start = [], 0
    for bits, count, size in zip(qp.bits, counts, qp.group_size):
        for _ in range(count):
            end = min(start + size, rows)
            groups.append((bits, end - start))
            start = end
    return groups


def check_exl2_groups(rows: int, groups: list[tuple[int, int]]) -> None:
    """What exllamav2 needs of a layout and never checks: every row in exactly one group, bits
    descending, each group whole packed words and whole shuffle units."""
    assert sum(r for _, r in groups) == rows, f"groups cover {sum(r for _, r in groups)} of {rows} rows"
    assert [b for b, _ in groups] == sorted((b for b, _ in groups), reverse=True), "bits must descend"
    for bits, count in groups:
        assert count > 0 and count * bits % 32 == 0 and count % SHUFFLE_ROWS[bits] == 0, (bits, count)


def exl2_bits(rows: int, columns: int, qp: QParams) -> int:
    """Stored bits of one matrix, as QParams.total_bits counts them (conversion/qparams.py)."""
    groups = exl2_groups(rows, qp)
    return sum(r * columns * b for b, r in groups) + len(groups) * (16 + 32 + columns * 4) + rows * 32


def mlp_option_6_layers(shape: Shape) -> int:
    """How many layers take MLP option 6 (the rest 7) for the decoder layers to average TARGET_BPW."""
    def bpw(layers_6: int) -> float:
        total = params = 0
        for layer in range(shape.layers):
            for (_, k, n), qp in zip(linears(shape), exl2_strategy(shape, layer, layers_6)):
                total += exl2_bits(k, n, qp)
                params += k * n
        return total / params
    return next((n for n in range(shape.layers + 1) if bpw(n) <= TARGET_BPW), shape.layers)


def exl2_strategy(shape: Shape, layer: int, layers_6: int) -> list[QParams]:
    """One decoder layer's options, in linears() order: attention 4-bit, MLP 6 in the first layers_6."""
    return [ATTENTION_4B] * 4 + list(MLP_OPTION_6 if layer < layers_6 else MLP_OPTION_7)


def scale_max(bits: int, std: float) -> float:
    """q_scale_max giving weights of about `std`: w = (q - 2^(b-1)) * (s + 1)^2 / 256 * max with q
    and the 4-bit s uniform (ext.py:334, q_gemm_kernel.cuh:259-271); E[(s+1)^4]^0.5 / 256 = 0.482."""
    return std / ((2**bits / math.sqrt(12)) * 0.482)


class Makers:
    """Random tensors on one device: a generator per writer thread, so threads never share one."""

    def __init__(self, device: str, seed: int) -> None:
        import torch

        self.torch, self.device = torch, device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def normal(self, *shape: int, std: float):
        return self.torch.randn(shape, generator=self.generator, device=self.device, dtype=self.torch.float16).mul_(std)

    def words(self, *shape: int, dtype=None):
        return self.torch.randint(-(2**31), 2**31 - 1, shape, generator=self.generator, device=self.device,
                                  dtype=dtype or self.torch.int32)

    def full(self, shape: tuple[int, ...], value: float, dtype):
        return self.torch.full(shape, value, dtype=dtype, device=self.device)

    def tensor(self, values: list, dtype):
        return self.torch.tensor(values, dtype=dtype, device=self.device)

    def permutation(self, n: int):
        return self.torch.randperm(n, generator=self.generator, device=self.device).to(self.torch.int32)


def entries(shape: Shape, fmt: str) -> Iterator[Entry]:
    """Every tensor of the model in file order; values are made only when asked for."""
    layers_6 = mlp_option_6_layers(shape) if fmt == "exl2" else 0
    vocab, hidden = shape.vocab, shape.hidden
    yield "model.embed_tokens.weight", "F16", (vocab, hidden), lambda make: make.normal(vocab, hidden, std=EMBED_STD)
    for layer in range(shape.layers):
        prefix = f"model.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield prefix + norm + ".weight", "F16", (hidden,), lambda make: make.full((hidden,), 1.0, make.torch.float16)
        strategy = exl2_strategy(shape, layer, layers_6)
        for (name, k, n), qp in zip(linears(shape), strategy):
            yield from linear(fmt, prefix + name, k, n, qp, LINEAR_STD)
    yield "model.norm.weight", "F16", (hidden,), lambda make: make.full((hidden,), 1.0, make.torch.float16)
    if fmt == "exl2":
        yield from exl2_linear("lm_head", shape.hidden, shape.vocab, HEAD_6B, HEAD_STD)
    else:
        yield "lm_head.weight", "F16", (vocab, hidden), lambda make: make.normal(vocab, hidden, std=HEAD_STD)


def linear(fmt: str, key: str, k: int, n: int, qp: QParams, std: float) -> Iterator[Entry]:
    if fmt == "fp16":
        yield key + ".weight", "F16", (n, k), lambda make: make.normal(n, k, std=std)
    elif fmt == "gptq":
        yield from gptq_linear(key, k, n, std)
    else:
        yield from exl2_linear(key, k, n, qp, std)


def gptq_linear(key: str, k: int, n: int, std: float) -> Iterator[Entry]:
    groups = k // GPTQ_GROUP
    scale = std / (16 / math.sqrt(12))  # (q - 8) of uniform nibbles has a standard deviation of 16 / sqrt(12)
    yield key + ".qweight", "I32", (k // 8, n), lambda make: make.words(k // 8, n)
    yield key + ".qzeros", "I32", (groups, n // 8), lambda make: make.full((groups, n // 8), 0x77777777, make.torch.int32)
    yield key + ".scales", "F16", (groups, n), lambda make: make.full((groups, n), scale, make.torch.float16)
    yield key + ".g_idx", "I32", (k,), lambda make: make.torch.arange(k, dtype=make.torch.int32, device=make.device) // GPTQ_GROUP


def exl2_linear(key: str, k: int, n: int, qp: QParams, std: float) -> Iterator[Entry]:
    groups = exl2_groups(k, qp)
    check_exl2_groups(k, groups)
    qrows = [rows * bits // 32 for bits, rows in groups]
    firsts = [sum(qrows[:i]) for i in range(len(groups))]
    q_groups = [value for (bits, _), first in zip(groups, firsts) for value in (bits, first)]
    maxima = [scale_max(bits, std) for bits, _ in groups]
    yield key + ".q_weight", "I32", (sum(qrows), n), lambda make: make.words(sum(qrows), n)
    yield key + ".q_scale", "I32", (len(groups), n // 8), lambda make: make.words(len(groups), n // 8)
    yield key + ".q_scale_max", "F16", (len(groups),), lambda make: make.tensor(maxima, make.torch.float16)
    yield key + ".q_groups", "I16", (2 * len(groups),), lambda make: make.tensor(q_groups, make.torch.int16)
    yield key + ".q_invperm", "I32", (k,), lambda make: make.permutation(k)


def shards(items: list[Entry]) -> list[list[Entry]]:
    """Consecutive tensors in files of at most SHARD_BYTES (a larger tensor gets a file of its own)."""
    out: list[list[Entry]] = [[]]
    size = 0
    for item in items:
        nbytes = nbytes_of(item)
        if out[-1] and size + nbytes > SHARD_BYTES:
            out.append([])
            size = 0
        out[-1].append(item)
        size += nbytes
    return out


def nbytes_of(item: Entry) -> int:
    return math.prod(item[2]) * DTYPE_BYTES[item[1]]


def header(items: list[Entry]) -> bytes:
    """The safetensors header: its JSON, padded with spaces to 8 bytes, after its 8-byte length."""
    table: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in items:
        name, dtype, shape, _ = item
        table[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes_of(item)]}
        offset += nbytes_of(item)
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_shard(path: pathlib.Path, items: list[Entry], make: Makers) -> int:
    """One file, one tensor in memory at a time; checks each made tensor against its header entry."""
    with path.open("wb") as file:
        file.write(header(items))
        for name, dtype, shape, values in items:
            tensor = values(make)
            assert tuple(tensor.shape) == shape and tensor.element_size() == DTYPE_BYTES[dtype], (name, tensor.shape)
            file.write(memoryview(tensor.contiguous().cpu().numpy()).cast("B"))
    return path.stat().st_size


def layout(shape: Shape, fmt: str) -> dict:
    """What would be written, without values: tensor count, bytes, bits per weight of the decoder layers."""
    items = list(entries(shape, fmt))
    linear_params = shape.layers * sum(k * n for _, k, n in linears(shape))
    layer_bytes = sum(nbytes_of(i) for i in items if i[0].startswith("model.layers.") and "layernorm" not in i[0])
    return {"shape": dataclasses.asdict(shape), "format": fmt, "tensors": len(items), "bytes": sum(map(nbytes_of, items)),
            "shards": len(shards(items)), "layer_bpw": round(layer_bytes * 8 / linear_params, 3),
            "mlp_option_6_layers": mlp_option_6_layers(shape) if fmt == "exl2" else None}


def quantization_config(fmt: str, shape: Shape) -> dict:
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": GPTQ_GROUP, "desc_act": False, "sym": True,
                "checkpoint_format": "gptq"}
    if fmt == "exl2":
        return {"quant_method": "exl2", "version": "0.3.2", "bits": TARGET_BPW, "head_bits": 6,
                "calibration": {"rows": 0, "length": 0, "dataset": "(random weights, bench/gpu/make_random_model.py)"}}
    return {}


def write_model(out: pathlib.Path, shape: Shape, fmt: str, texts: list[pathlib.Path], device: str, seed: int) -> dict:
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    config = model_config() | {
        "hidden_size": shape.hidden, "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab,
        "rope_theta": shape.rope_theta, "max_position_embeddings": shape.context,
    }
    if fmt != "fp16":
        config["quantization_config"] = quantization_config(fmt, shape)
    write_side_files(out, config, train_tokenizer(texts))
    files = shards(list(entries(shape, fmt)))
    names = [out / f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    with concurrent.futures.ThreadPoolExecutor(len(files)) as pool:  # each shard from its own generator
        jobs = [pool.submit(write_shard, name, items, Makers(device, seed + i))
                for i, (name, items) in enumerate(zip(names, files))]
        sizes = [job.result() for job in jobs]
    return layout(shape, fmt) | {"out": str(out), "written_bytes": sum(sizes), "seconds": round(time.perf_counter() - started, 1),
                                "device": device}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--format", choices=FORMATS, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--text", type=pathlib.Path, nargs="+", help="tokenizer training text (default: the docs)")
    parser.add_argument("--device", help="where tensors are made (default: cuda if torch sees a GPU, else cpu)")
    parser.add_argument("--seed", type=int, default=8)
    parser.add_argument("--dry-run", action="store_true", help="check and print the layout; write nothing")
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    if args.dry_run:
        print(json.dumps(layout(shape, args.format)))
        return 0
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    texts = args.text or sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    print(json.dumps(write_model(args.out, shape, args.format, texts, device, args.seed)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
