"""What a Hugging Face model directory says about itself, read from its files without loading it
(either exllama generation's engine, and each front end beside it)."""

from __future__ import annotations

import json
import pathlib
import struct
from typing import Any

from backend.common.models import ModelError


def find_model_dir(path: str, setting: str, engine: str) -> pathlib.Path:
    """The model directory a setting names. Raises ModelError when it lacks what the exllama engines read."""
    directory = pathlib.Path(path).expanduser()
    missing = [name for name in ("config.json", "tokenizer.json") if not (directory / name).is_file()]
    if missing:  # both read only tokenizer.json; SentencePiece-only models are not supported
        raise ModelError(
            f"{setting}: {engine} needs a model directory with config.json and tokenizer.json; "
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
    """"EXL3 4.0 bpw", "EXL2 4.0 bpw", "GPTQ 4-bit", "BF16" or "FP16": from config.json's quantization_config
    (exllamav3's converter writes quant_method "exl3" and bits there), else from the tensor names in the
    safetensors headers (as the libraries decide), and for unquantized weights their dtype."""
    config = model_config(model_dir, "config.json")
    quantization = config.get("quantization_config") or {}
    method, bits = str(quantization.get("quant_method", "")).lower(), quantization.get("bits")
    if method in ("exl3", "exl2"):
        return f"{method.upper()} {bits} bpw" if bits else method.upper()
    if method == "gptq":
        return f"GPTQ {bits}-bit" if bits else "GPTQ"
    tensors = tensor_headers(model_dir)
    for suffix, name in ((".trellis", "EXL3"), (".q_weight", "EXL2"), (".qweight", "GPTQ")):
        if any(tensor.endswith(suffix) for tensor in tensors):
            return name
    return "BF16" if any(header.get("dtype") == "BF16" for header in tensors.values()) else "FP16"


def tensor_headers(model_dir: pathlib.Path) -> dict[str, dict[str, Any]]:
    """Every tensor's header entry (dtype, shape), from the safetensors files' headers alone."""
    return {name: header for path in sorted(model_dir.glob("*.safetensors")) for name, header in _header(path).items()}


def _header(path: pathlib.Path) -> dict[str, dict[str, Any]]:
    """A safetensors file starts with an 8-byte little-endian length and that much JSON header."""
    with path.open("rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        return {name: value for name, value in json.loads(file.read(length)).items() if name != "__metadata__"}
