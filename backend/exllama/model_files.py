"""What a model directory says about itself, read from its files without loading it."""

from __future__ import annotations

import json
import pathlib
import struct
from typing import Any

from backend.common.models import ModelError


def find_model_dir(path: str, setting: str) -> pathlib.Path:
    """The exllamav2 model directory a setting names. Raises ModelError when it lacks what exllamav2 reads."""
    directory = pathlib.Path(path).expanduser()
    missing = [name for name in ("config.json", "tokenizer.json") if not (directory / name).is_file()]
    if missing:  # exllamav2 reads only tokenizer.json; SentencePiece-only models are not supported
        raise ModelError(
            f"{setting}: exllamav2 needs a model directory with config.json and tokenizer.json; "
            f"{directory} lacks {', '.join(missing)}"
        )
    return directory


def model_config(model_dir: pathlib.Path, name: str) -> dict[str, Any]:
    path = model_dir / name
    return json.loads(path.read_text()) if path.is_file() else {}


def end_token_ids(model_dir: pathlib.Path, tokenizer_eos: int | None) -> tuple[int, ...]:
    """Every id that ends generation, each of which must stop a job: config.json's (read here:
    exllamav2 keeps only the first of a list), generation_config.json's, and the tokenizer's."""
    ids: set[int] = set() if tokenizer_eos is None else {tokenizer_eos}
    for name in ("config.json", "generation_config.json"):
        listed = model_config(model_dir, name).get("eos_token_id")
        ids.update(listed if isinstance(listed, list) else [] if listed is None else [listed])
    return tuple(sorted(ids))


def adds_bos(model_dir: pathlib.Path, bos_token: str) -> bool:
    """Whether a plain prompt starts with BOS, as transformers would encode it: tokenizer_config.json's
    add_bos_token when it says, else whether tokenizer.json's post-processor puts BOS first (Llama 3)."""
    setting = model_config(model_dir, "tokenizer_config.json").get("add_bos_token")
    if setting is not None:
        return bool(setting)
    processor = model_config(model_dir, "tokenizer.json").get("post_processor") or {}
    for step in processor.get("processors", [processor]):
        if step.get("type") == "TemplateProcessing" and step.get("single"):
            first: object = step["single"][0].get("SpecialToken", {}).get("id")
            return first == bos_token
    return False


def weight_format(model_dir: pathlib.Path) -> str:
    """"EXL2 4.0 bpw", "GPTQ 4-bit" or "FP16": from config.json's quantization_config, else from
    the tensor names in the safetensors headers (exllamav2 itself decides by those)."""
    quantization = model_config(model_dir, "config.json").get("quantization_config") or {}
    method, bits = str(quantization.get("quant_method", "")).lower(), quantization.get("bits")
    if method == "exl2":
        return f"EXL2 {bits} bpw" if bits else "EXL2"
    if method == "gptq":
        return f"GPTQ {bits}-bit" if bits else "GPTQ"
    names = set(_tensors(model_dir))
    if any(name.endswith(".q_weight") for name in names):
        return "EXL2"
    if any(name.endswith(".qweight") for name in names):
        return "GPTQ"
    return "FP16"


def unloadable_weights(model_dir: pathlib.Path) -> str:
    """Why exllamav2 0.3.2 cannot load these weights, or "". Its GPTQ kernel takes only 4-bit weights,
    8 to an int32 (ext_qmatrix.cpp:66 checks qweight's columns against qzeros' times 8), and it never
    reads quantization_config.bits, so another width would fail inside the extension, on the GPU."""
    quantization = model_config(model_dir, "config.json").get("quantization_config") or {}
    bits = quantization.get("bits")
    if str(quantization.get("quant_method", "")).lower() == "gptq" and bits not in (None, 4):
        return f"exllamav2 loads only 4-bit GPTQ weights; this model's config.json says {bits}-bit"
    tensors = _tensors(model_dir)
    for name, header in tensors.items():
        zeros = tensors.get(name.removesuffix(".qweight") + ".qzeros")
        if name.endswith(".qweight") and zeros and header["shape"][1] != zeros["shape"][1] * 8:
            return f"exllamav2 loads only 4-bit GPTQ weights; {name} is not packed 8 to an int32"
    return ""


def _tensors(model_dir: pathlib.Path) -> dict[str, dict[str, Any]]:
    """Every tensor's header entry (dtype, shape), from the safetensors files' headers alone."""
    return {name: header for path in sorted(model_dir.glob("*.safetensors")) for name, header in _header(path).items()}


def _header(path: pathlib.Path) -> dict[str, dict[str, Any]]:
    """A safetensors file starts with an 8-byte little-endian length and that much JSON header."""
    with path.open("rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        return {name: value for name, value in json.loads(file.read(length)).items() if name != "__metadata__"}
