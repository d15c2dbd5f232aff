"""Decode tokens/s of greedy streams run together, measured alike through tokenspout's gRPC and with
exllamav2 driven directly (the generator built as the engine builds it): what the service costs.
Used by bench/gpu/check.py; the engine steps the streams took show whether they were batched."""

from __future__ import annotations

import concurrent.futures
import pathlib
import statistics
import threading
import time

from bench.gpu.model_check import PROMPT
from bench.harness.streams import greedy_request
from tokenspout.v1 import generation_pb2 as pb

CONTEXT, BATCH, RATE_TOKENS = 2048, 16, 256  # BATCH: 16 streams decode together
RATE_STREAMS = (1, 4, 16)
RATE_REPS = 3
RATIO_TARGET = 0.97
RPC_TIMEOUT_S = 30  # unary calls; a stream has helpers.stream's 120 s


class BatchWatcher:
    """GetServerStatus polled while streams run: the most sequences the engine ran at once, and the
    engine steps the streams took."""

    def __init__(self, stub, interval_s: float = 0.002) -> None:
        self.stub, self.interval_s = stub, interval_s
        self.most_running, self.steps = 0, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _status(self) -> pb.GetServerStatusResponse:
        return self.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=RPC_TIMEOUT_S)

    def _poll(self) -> None:
        while not self._done.is_set():
            self.most_running = max(self.most_running, self._status().running_sequences)
            self._done.wait(self.interval_s)

    def __enter__(self) -> BatchWatcher:
        self._steps_before = self._status().engine_steps
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        self._thread.join(timeout=RPC_TIMEOUT_S)
        self.steps = self._status().engine_steps - self._steps_before


Timeline = list[tuple[float, int]]
"""One stream's (arrival time, tokens so far), one entry per arrival that brought tokens."""


def tokens_at(timeline: Timeline, when: float) -> int:
    return max((count for at, count in timeline if at <= when), default=0)


def window_rate(timelines: list[Timeline]) -> float:
    """Decode tokens/s of streams run together, measured alike through gRPC and directly: the tokens
    all of them received while all of them were decoding (from the last one's first token to the
    first one's last), over that time. One stream: tokens after the first over the time they took.
    Streams that never overlapped (an unpaged engine takes them in turn): all tokens after each
    stream's first, over the time from the first first token to the last last one."""
    start, end = max(t[0][0] for t in timelines), min(t[-1][0] for t in timelines)
    if end > start:
        return sum(tokens_at(t, end) - tokens_at(t, start) for t in timelines) / (end - start)
    span = max(t[-1][0] for t in timelines) - min(t[0][0] for t in timelines)
    if span <= 0:
        raise ValueError("every token arrived at once: no decode rate to measure")
    return sum(t[-1][1] - t[0][1] for t in timelines) / span


def generator_rate(generator, count: int, length: int) -> float:
    """Decode tokens/s (window_rate) of the `count` jobs enqueued on an exllama generator (v2 or v3: the same
    iterate() results), identifiers 0 to count-1 and `length` tokens each, iterated to their end."""
    timelines: list[Timeline] = [[] for _ in range(count)]
    while generator.num_remaining_jobs():
        results = generator.iterate()
        now = time.perf_counter()
        for result in results:
            if result.get("token_ids") is not None:  # one result may carry several held-back tokens
                timeline = timelines[result["identifier"]]
                timeline.append((now, (timeline[-1][1] if timeline else 0) + result["token_ids"].shape[-1]))
    assert all(t[-1][1] == length for t in timelines), [t[-1][1] for t in timelines]
    return window_rate(timelines)


def rate_prompts(count: int = max(RATE_STREAMS)) -> list[str]:
    return [f"{PROMPT} {i}" for i in range(count)]


def stream_timeline(stub, request: pb.GenerateStreamRequest, start: threading.Barrier | None = None) -> Timeline:
    if start is not None:
        start.wait()
    timeline: Timeline = []
    for message in stub.GenerateStream(request, timeout=300):
        if message.generated_tokens > (timeline[-1][1] if timeline else 0):
            timeline.append((time.perf_counter(), message.generated_tokens))
    return timeline


def grpc_rates(stub, streams=RATE_STREAMS, tokens: int = RATE_TOKENS, reps: int = RATE_REPS,
               warmup: tuple[tuple[int, int], ...] | None = None) -> dict:
    """Decode tokens/s through gRPC with 1, 4 and 16 greedy streams at once (median of reps), and
    the engine steps each took. `warmup`: (streams, tokens) runs first, untimed (default: 16 tokens
    at the most streams, the batched path's first run)."""
    prompts = rate_prompts(max(streams))

    def together(count: int, length: int) -> tuple[float, int]:
        start = threading.Barrier(count)
        steps = stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=RPC_TIMEOUT_S).engine_steps
        with concurrent.futures.ThreadPoolExecutor(count) as pool:
            timelines = list(pool.map(lambda p: stream_timeline(stub, greedy_request(p, length), start), prompts[:count]))
        assert all(t[-1][1] == length for t in timelines), [t[-1][1] for t in timelines]
        steps = stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=RPC_TIMEOUT_S).engine_steps - steps
        return window_rate(timelines), steps

    for count, length in warmup or ((max(streams), 16),):
        together(count, length)
    rates, steps = {}, {}
    for count in streams:
        runs = [together(count, tokens) for _ in range(reps)]
        rates[str(count)] = statistics.median(rate for rate, _ in runs)
        steps[str(count)] = max(step for _, step in runs)
        print(f"  gRPC, {count} streams: {rates[str(count)]:.1f} tok/s, {steps[str(count)]} engine steps", flush=True)
    return {"tok_s": rates, "engine_steps": steps}


def direct_rates(model_dir: pathlib.Path, setting: str, prompt_ids: list[list[int]], streams=RATE_STREAMS,
                 tokens: int = RATE_TOKENS, reps: int = RATE_REPS) -> dict:
    """Decode tokens/s of the same greedy jobs, exllamav2 driven directly: imported through the
    engine's attention provider with the server's setting, its generator built as the engine builds it."""
    direct = Direct(model_dir, setting, CONTEXT, BATCH)
    direct.together(prompt_ids, max(streams), 16)  # warm-up, as through gRPC
    rates = {}
    for count in streams:
        rates[str(count)] = statistics.median(direct.together(prompt_ids, count, tokens) for _ in range(reps))
        print(f"  directly, {count} streams: {rates[str(count)]:.1f} tok/s", flush=True)
    direct.model.unload()
    return {"tok_s": rates, "provider": direct.provider, "paged": direct.sizes.paged, "setting": setting}


class Direct:
    """exllamav2 imported through the engine's attention provider with `setting`, the model loaded
    and its generator built as the engine builds them (context, batch and cache sizes as the server's)."""

    def __init__(self, model_dir: pathlib.Path, setting: str, context: int, batch: int, cache_tokens: int = 0) -> None:
        from backend.config import EngineConfig, ExLlamaV2Settings
        from backend.exllamav2.attention_provider import import_exllamav2
        from backend.exllamav2.loading import load_model_and_cache
        from backend.exllamav2.sizes import generator_fields, generator_sizes, speculation

        self.exllamav2, self.provider = import_exllamav2(setting)
        import torch
        from exllamav2.attn import has_flash_attn_with_paged
        from exllamav2.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob, ExLlamaV2Sampler

        self.torch, self.job_class, self.sampler = torch, ExLlamaV2DynamicJob, ExLlamaV2Sampler
        config = EngineConfig(model=str(model_dir), context_length=context, max_batch_size=batch,
                              exllamav2=ExLlamaV2Settings(cache_tokens=cache_tokens))
        self.xconfig = xconfig = self.exllamav2.ExLlamaV2Config(str(model_dir))
        xconfig.arch_compat_overrides()
        self.sizes = sizes = generator_sizes(config, has_flash_attn_with_paged, xconfig.no_flash_attn)
        xconfig.max_seq_len, xconfig.max_input_len, xconfig.max_attention_size = sizes.max_seq_len, sizes.chunk, sizes.chunk**2
        own = config.exllamav2
        self.model, self.cache = load_model_and_cache(self.exllamav2, xconfig, own.cache_type, sizes.cache_tokens, own.gpu_split)
        self.tokenizer = self.exllamav2.ExLlamaV2Tokenizer(xconfig, lazy_init=False)
        self.generator = ExLlamaV2DynamicGenerator(
            model=self.model, cache=self.cache, tokenizer=self.tokenizer, **generator_fields(sizes, speculation(config, False))
        )

    def together(self, prompt_ids: list[list[int]], count: int, length: int) -> float:
        """Decode tokens/s of `count` greedy jobs of `length` tokens run at once (window_rate)."""
        for i, ids in enumerate(prompt_ids[:count]):
            self.generator.enqueue(self.job_class(
                input_ids=self.torch.tensor([ids], dtype=self.torch.long), max_new_tokens=length, stop_conditions=[],
                gen_settings=self.sampler.Settings.greedy(), identifier=i,
            ))
        try:
            return generator_rate(self.generator, count, length)
        except BaseException:
            self.generator.clear_queue()  # a failed run's jobs never reach the next one
            raise


def rate_table(through_grpc: dict, direct: dict) -> dict:
    """Per stream count: gRPC tok/s, direct tok/s and their ratio, where both were measured."""
    ratios = {n: through_grpc[n] / direct[n] for n in through_grpc if direct.get(n)}
    return {"streams": [int(n) for n in through_grpc], "grpc_tok_s": through_grpc, "direct_tok_s": direct, "ratio": ratios,
            "target": RATIO_TARGET, "below_target": [int(n) for n, r in ratios.items() if r < RATIO_TARGET]}
