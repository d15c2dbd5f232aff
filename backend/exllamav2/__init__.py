"""EXL2 and GPTQ models through exllamav2's dynamic generator (work in progress).

`import exllamav2` compiles a CUDA extension, so nothing here imports it at
module level: the pure parts (sampler settings, result translation, the
owner-thread core driving any object with the generator's queue API) are
tested on CPU with a fake generator; the concrete loader comes with a GPU.
"""
