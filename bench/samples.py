"""n samples of one prompt against n separate requests of it, every figure from one run.

At a ~1,000-token prompt, one request with n = 4 against 4 separate requests of the same prompt
sent at once (each with its own seed; a fresh prompt per rep, so no rep finds another's cache).
Prints, medians over the reps: wall time of the whole call, and prompt rows computed (the
engine's prompt_tokens_total - cached_prompt_tokens_total deltas), with the ratios n = 4 / separate.
The separate requests may share cells through the prefix cache too (a live neighbour's prompt is
copied once computed), so the baseline is the server at its best, not a straw man; and with
--no-prefix-cache, the server without it.

    python -m bench.samples [--reps 5] [--samples 4] [--new-tokens 32] [--no-prefix-cache]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import pathlib
import secrets
import statistics
import tempfile
import time

import grpc

from tests.harness.servers import start_server, stop_server
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent

PROMPT_TOKENS = 1000


def prompt(stub) -> str:
    """About PROMPT_TOKENS tokens, unique to this call."""
    words = [f"Log {secrets.token_hex(4)}:"]
    while True:
        words += [f"entry {len(words)} reads {len(words) * 7 % 97} units;" for _ in range(40)]
        text = " ".join(words) + " Summary:"
        if stub.Tokenize(pb.TokenizeRequest(text=text)).count >= PROMPT_TOKENS:
            return text


def request(text: str, n: int, seed: int, new_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=text, n=n, sampling=pb.SamplingParams(temperature=0.8, seed=seed),
                              stopping=pb.StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True))


def computed_rows(stub, call) -> tuple[float, int]:
    """Wall seconds of `call()` and the prompt rows the engine computed meanwhile."""
    before = stub.GetServerStatus(pb.GetServerStatusRequest())
    start = time.perf_counter()
    call()
    wall = time.perf_counter() - start
    after = stub.GetServerStatus(pb.GetServerStatusRequest())
    rows = (after.prompt_tokens_total - before.prompt_tokens_total) - (
        after.cached_prompt_tokens_total - before.cached_prompt_tokens_total)
    return wall, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--no-prefix-cache", action="store_true")
    args = parser.parse_args()
    n = args.samples
    flags = ["--context-length", "2048", "--max-batch-size", str(max(4, n))]
    with tempfile.TemporaryDirectory() as tmp:
        env_flags = ["--prefix-cache", "false"] if args.no_prefix_cache else []
        server = start_server(pathlib.Path(tmp), *flags, *env_flags)
        try:
            with grpc.insecure_channel(server.address) as channel, concurrent.futures.ThreadPoolExecutor(n) as pool:
                stub = pb_grpc.GenerationServiceStub(channel)
                stub.Generate(request("warm up", 1, 1, 4), timeout=300)
                together, apart, lengths = [], [], []
                for rep in range(args.reps):  # alternate, so machine noise hits both alike
                    text = prompt(stub)
                    lengths.append(stub.Tokenize(pb.TokenizeRequest(text=text)).count)
                    together.append(computed_rows(stub, lambda text=text, rep=rep: stub.Generate(
                        request(text, n, rep, args.new_tokens), timeout=600)))
                    text = prompt(stub)

                    def calls(text: str = text, rep: int = rep) -> list[pb.GenerateResponse]:
                        return list(pool.map(
                            lambda i: stub.Generate(request(text, 1, rep + i, args.new_tokens), timeout=600), range(n)))

                    apart.append(computed_rows(stub, calls))
        finally:
            stop_server(server)
    wall_n, rows_n = statistics.median(w for w, _ in together), statistics.median(r for _, r in together)
    wall_1, rows_1 = statistics.median(w for w, _ in apart), statistics.median(r for _, r in apart)
    cache = "off" if args.no_prefix_cache else "on"
    length = statistics.median(lengths)
    print(f"{length:.0f}-token prompt, {args.new_tokens} new tokens a sample, prefix cache {cache}, "
          f"{args.reps} reps (medians)")
    print(f"  n = {n}, one request:      {wall_n:6.2f} s wall, {rows_n:6.0f} prompt rows computed")
    print(f"  {n} separate requests:      {wall_1:6.2f} s wall, {rows_1:6.0f} prompt rows computed")
    print(f"  ratio n = {n} / separate: wall {wall_n / wall_1:.2f}x, prompt rows {rows_n / rows_1:.2f}x")
    print(f"  prompt rows computed / ({n} x prompt length): {rows_n / (n * length):.2f} (target <= 0.3)")


if __name__ == "__main__":
    main()
