"""Config, model, cache and tokenizer as exllamav2 0.3.2 names and calls them (the parts tokenspout uses)."""

from __future__ import annotations

import json
import pathlib

import tokenizers
import torch

from backend.exllama.model_files import tensor_headers

LINEAR_KEYS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SUFFIXES = {".q_weight": ("q_invperm", "q_scale", "q_scale_max", "q_groups"), ".qweight": ("qzeros", "scales"),
            ".weight": ()}


class ExLlamaV2Config:
    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
        self.vocab_size, self.num_hidden_layers = config["vocab_size"], config["num_hidden_layers"]
        self.max_seq_len = config.get("max_position_embeddings", 2048)
        self.max_input_len, self.max_attention_size, self.max_batch_size = 2048, 2048**2, 1
        self.no_flash_attn, self.bos_token_id = False, config.get("bos_token_id", 1)

    def arch_compat_overrides(self) -> None:
        pass


class ExLlamaV2:
    def __init__(self, config: ExLlamaV2Config) -> None:
        self.config, self.loaded = config, False

    def load_autosplit(self, cache) -> None:
        self.load()

    def load(self, gpu_split: list[float] | None = None) -> None:
        """Every tensor 0.3.2 would read, found in the safetensors headers with a format it knows."""
        names = set(tensor_headers(pathlib.Path(self.config.model_dir)))
        keys = ["lm_head"] + [f"model.layers.{i}.{key}" for i in range(self.config.num_hidden_layers) for key in LINEAR_KEYS]
        for key in keys:
            suffix = next((s for s in SUFFIXES if key + s in names), None)
            if suffix is None:
                raise ValueError(f"no {key}.q_weight, .qweight or .weight in the model's safetensors")
            missing = [part for part in SUFFIXES[suffix] if f"{key}.{part}" not in names]
            if missing:
                raise ValueError(f"{key}: {', '.join(missing)} missing")
        for name in ("model.embed_tokens.weight", "model.norm.weight"):
            if name not in names:
                raise ValueError(f"{name} missing")
        self.loaded = True

    def unload(self) -> None:
        self.loaded = False

    def forward(self, input_ids: torch.Tensor, cache=None, **kwargs) -> torch.Tensor:
        assert self.loaded, "forward before load"
        if cache is not None:
            cache.current_seq_len += input_ids.shape[-1]
        generator = torch.Generator().manual_seed(int(input_ids.sum()))
        return torch.randn(*input_ids.shape, self.config.vocab_size, generator=generator)


class ExLlamaV2Cache:
    def __init__(self, model: ExLlamaV2, max_seq_len: int = -1, lazy: bool = False, batch_size: int = 1) -> None:
        assert lazy or model.loaded or max_seq_len > 0
        self.max_seq_len, self.batch_size, self.current_seq_len = max_seq_len, batch_size, 0


class ExLlamaV2Tokenizer:
    def __init__(self, config: ExLlamaV2Config, lazy_init: bool = True) -> None:
        self.tokenizer = tokenizers.Tokenizer.from_file(str(pathlib.Path(config.model_dir) / "tokenizer.json"))
        self.bos_token_id = config.bos_token_id

    def encode(self, text: str, add_bos: bool = False, **kwargs) -> torch.Tensor:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return torch.tensor([[self.bos_token_id] * add_bos + ids])
