"""EXL2, GPTQ and FP16 models through exllamav2 0.3.2's dynamic generator: its binding to the shared
exllama room (backend.exllama), its loading order, sampler settings and generator sizes, and the paged
attention it can run on without flash-attn (attention_provider; paged_attention, paged_attention_triton).

`import exllamav2` compiles a CUDA extension, so nothing here imports it at module level: the engine
imports it when it starts, and the rest is tested on CPU against doubles checked with 0.3.2's source.
"""
