"""The sections of docs/benchmarks.md, in order; a result names its section (`Benchmark.area`). Titles are link
targets (README and docs/ link to them): keep them."""

AREAS: tuple[str, ...] = (
    "Streaming overhead",
    "The service at a GPU's pace",
    "The engine in a process of its own",
    "Time to first token and decode against llama-server",
    "Threads",
    "Slot order in llama.cpp's cache",
    "Constraints",
    "Prefix cache and affinity",
    "KV-cache events",
    "Tool calls",
    "Fair sharing",
    "Speculative decoding",
    "Samplers",
    "Client, authentication, tracing and proxy overhead",
    "Robustness",
    "Against an older version",
    "exllamav2 on a GPU",
)
