"""A stand-in for exllamav2 0.3.2 on the CPU: the GPU run rehearsed (bench/gpu/rehearse.sh --real-size)
puts this folder's parent on PYTHONPATH, so run.sh's real-size stages and bench/gpu/real_size.py run
through end to end with no GPU. Real: the attention detection at import (attn.py, 0.3.2's code), the
model directory's files (config.json, tokenizer.json, the safetensors headers, checked for every tensor
0.3.2 would load), the tokenizer, and in paged mode every decode step's attention through the provider
tokenspout lent it (its SDPA or Triton code, on CPU tensors). Stood in for: the weights' arithmetic
(logits are seeded noise) and the CUDA extension.
"""

__version__ = "0.3.2-stand-in"

from . import attn  # noqa: F401  # exllamav2/model.py imports it as the package loads: detection runs now
from .model import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer  # noqa: F401
