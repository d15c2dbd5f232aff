"""EXL3, FP16 and BF16 models through exllamav3 1.6.5's Generator: its binding to the shared exllama room
(backend.exllama), its loading order, its sampler steps, and the sizes its generator, cache and loader are
built with.

`import exllamav3` compiles a CUDA extension (unless a prebuilt one imports), so nothing here imports it
at module level: the engine imports it when it starts, and the rest is tested on CPU against doubles
checked with 1.6.5's source (tests/backend/exllamav3/test_signatures.py).
"""
