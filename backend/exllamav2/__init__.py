"""EXL2 and GPTQ models through exllamav2's dynamic generator.

`import exllamav2` compiles a CUDA extension, so nothing here imports it at
module level: the pure parts (sampler settings, job fields, result translation,
the owner-thread core driving any object with the generator's queue API, the
generator's sizes, the model-then-cache order, the vocabulary) are tested on CPU,
against fakes that behave like exllamav2 0.3.2 and real tokenizers; the engine
that wires them to exllamav2 runs only on a GPU (bench/gpu/).
"""
