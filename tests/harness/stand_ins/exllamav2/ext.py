"""exllamav2.ext's one fact run.sh's extension stage reads: the prebuilt extension is in use (no JIT build)."""

build_jit = False
