"""Builds a tiny random-weight Llama, and a GPTQ copy of it, for the GPU check.

The machine that runs the check reaches no model hub, so the model is made here:
a byte-level BPE tokenizer trained on exllamav2's own calibration text (with
ChatML turn tokens and a chat template), FP16 safetensors weights from a fixed
seed, and a 4-bit GPTQ copy (round-to-nearest, symmetric, group 128, in the
AutoGPTQ layout that exllamav2 loads). EXL2 comes from exllamav2's converter.

    python bench/gpu/tiny_llama.py OUT_DIR --text FILE [FILE ...]
      -> OUT_DIR/fp16 and OUT_DIR/gptq
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0..3
# Random weights from this seed keep the top two greedy logits >= 0.05 apart over the check's 16
# steps (bench/gpu/model_check.py measures it); from seed 0 they come within 0.01, and FP16
# rounding then flips tokens between exllamav2 and transformers.
WEIGHT_SEED = 2
VOCAB_SIZE = 4096
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 512, 1536, 4, 8, 4
GROUP_SIZE = 128
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(texts: list[pathlib.Path]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte has a token
        show_progress=False,
    )
    tokenizer.train([str(t) for t in texts], trainer)
    # BOS first, as transformers then encodes a prompt; tokenspout adds it from add_bos_token alike.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    return tokenizer


def model_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float16",
    }


def random_weights(seed: int = WEIGHT_SEED) -> dict[str, np.ndarray]:
    """Llama tensors in Hugging Face names and layouts ([out, in] for linear layers)."""
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS

    def normal(*shape: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float16)

    tensors = {"model.embed_tokens.weight": normal(VOCAB_SIZE, HIDDEN, std=1.0)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(HIDDEN, np.float16),
            p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float16),
            p + "self_attn.q_proj.weight": normal(HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": normal(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": normal(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": normal(HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": normal(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": normal(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": normal(HIDDEN, INTERMEDIATE),
        }
    tensors["model.norm.weight"] = np.ones(HIDDEN, np.float16)
    # A wider head than Llama's init gives the random model clear preferences, so greedy output is stable.
    tensors["lm_head.weight"] = normal(VOCAB_SIZE, HIDDEN, std=0.05)
    return tensors


def _pack_rows(values: np.ndarray) -> np.ndarray:
    """Packs 4-bit values eight to an int32 along axis 0 (value j of a word in bits 4j..4j+3)."""
    rows, cols = values.shape
    grouped = values.reshape(rows // 8, 8, cols).astype(np.uint32)
    packed = np.zeros((rows // 8, cols), np.uint32)
    for j in range(8):
        packed |= grouped[:, j, :] << np.uint32(4 * j)
    return packed.view(np.int32)


def gptq_quantize(weight: np.ndarray) -> dict[str, np.ndarray]:
    """Round-to-nearest 4-bit GPTQ (v1 layout) of one [out, in] weight: w ~= scale * (q - zero).

    Zeros are stored minus one, as AutoGPTQ's v1 checkpoints store them and exllamav2 expects.
    """
    w = weight.astype(np.float32).T  # [in, out], GPTQ's orientation
    n_in, n_out = w.shape
    groups = w.reshape(n_in // GROUP_SIZE, GROUP_SIZE, n_out)
    scales = np.maximum(np.abs(groups).max(axis=1), 1e-8) / 7.0  # [groups, out]
    zero = 8
    q = np.clip(np.rint(groups / scales[:, None, :]) + zero, 0, 15).astype(np.uint32).reshape(n_in, n_out)
    stored_zeros = np.full((n_in // GROUP_SIZE, n_out), zero - 1, np.uint32)
    return {
        "qweight": _pack_rows(q),
        "qzeros": _pack_rows(stored_zeros.T).T.copy(),  # packed along the output axis
        "scales": scales.astype(np.float16),
        "g_idx": (np.arange(n_in) // GROUP_SIZE).astype(np.int32),
    }


def gptq_dequantize(q: dict[str, np.ndarray]) -> np.ndarray:
    """The [out, in] weight a GPTQ tensor set stands for (to check the packing)."""
    qweight = q["qweight"].view(np.uint32)
    values = np.stack([(qweight >> np.uint32(4 * j)) & 0xF for j in range(8)], axis=1).reshape(-1, qweight.shape[1])
    qzeros = q["qzeros"].view(np.uint32)
    zeros = np.stack([(qzeros >> np.uint32(4 * j)) & 0xF for j in range(8)], axis=2).reshape(qzeros.shape[0], -1) + 1
    group = q["g_idx"]
    return ((values.astype(np.float32) - zeros[group]) * q["scales"][group].astype(np.float32)).T


def gptq_tensors(fp16: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, tensor in fp16.items():
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED:
            base = name.removesuffix(".weight")
            out |= {f"{base}.{part}": value for part, value in gptq_quantize(tensor).items()}
        else:
            out[name] = tensor
    return out


def check_gptq(fp16: dict[str, np.ndarray], quantized: dict[str, np.ndarray]) -> None:
    """Every quantized weight unpacks to within half a step of the original."""
    for name, weight in fp16.items():
        base = name.removesuffix(".weight")
        if base + ".qweight" not in quantized:
            continue
        parts = {part: quantized[f"{base}.{part}"] for part in ("qweight", "qzeros", "scales", "g_idx")}
        error = np.abs(gptq_dequantize(parts) - weight.astype(np.float32))
        step = parts["scales"].astype(np.float32)[parts["g_idx"]].T  # [out, in]
        assert (error <= step / 2 + 1e-3).all(), f"{base}: GPTQ packing is wrong"


def write_model(directory: pathlib.Path, tensors: dict[str, np.ndarray], config: dict, tokenizer: Tokenizer) -> None:
    from safetensors.numpy import save_file  # here: the tokenizer alone (tests/backend/exllamav2/test_vocabulary.py) needs none

    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    write_side_files(directory, config, tokenizer)


def write_side_files(directory: pathlib.Path, config: dict, tokenizer: Tokenizer) -> None:
    """Everything but the weights: config, generation config, tokenizer and its config, special tokens."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    # Two end ids: the checks see that every one of them ends a job.
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 3]}))
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_bos_token": True,
                "add_eos_token": False,
                "bos_token": "<s>",
                "eos_token": "</s>",
                "chat_template": CHATML,
                "model_max_length": config.get("max_position_embeddings", 2048),
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=2,
        )
    )
    (directory / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--text", type=pathlib.Path, nargs="+", required=True, help="text to train the tokenizer on")
    parser.add_argument("--seed", type=int, default=WEIGHT_SEED, help="seed of the random weights")
    args = parser.parse_args()
    tokenizer = train_tokenizer(args.text)
    fp16 = random_weights(args.seed)
    write_model(args.out / "fp16", fp16, model_config(), tokenizer)
    quantized = gptq_tensors(fp16)
    check_gptq(fp16, quantized)
    gptq_config = model_config() | {
        "quantization_config": {
            "quant_method": "gptq", "bits": 4, "group_size": GROUP_SIZE, "desc_act": False, "sym": True,
            "checkpoint_format": "gptq",
        }
    }
    write_model(args.out / "gptq", quantized, gptq_config, tokenizer)
    print(f"tiny Llama: vocab {tokenizer.get_vocab_size()}, weight seed {args.seed}, fp16 and GPTQ written under {args.out}")


if __name__ == "__main__":
    main()
