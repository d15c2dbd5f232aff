"""Several tokens a step: which tokens to propose, and how many are worth checking.

A decoding sequence feeds its last sampled token and the tokens its constraint
forced (output already, never checked), then up to k proposed tokens; the
decode gives logits after every row, and the core samples each row in turn
with the sequence's own chain, accepting a proposal while it equals the token
sampled before it (backend.llamacpp.rows). A proposal is deterministic, so the
output's distribution is exactly that of plain decoding (and llama.cpp computes
a row of a small group bit for bit as it computes one alone: docs/benchmarks.md).

Proposals come from n-gram lookup in the sequence's own prompt and output: the
longest recent n-gram that occurred before is continued by what followed it
then, as llama.cpp's ngram modes do; failing that, from what followed its last
4-gram in its caller's finished sequences. Each step the planner picks the
draft length that gives the most tokens per second by what each source's
proposals are expected to get accepted and what rows cost on this machine, and
none at all when no length beats plain decoding. The rooms:

    speculator  the one object the core owns: extend(feeds) each step, learn(...) after its decode
    drafts      what a sequence proposes, and how each source's proposals fare (per sequence, per engine)
    proposers   where proposals come from: n-gram index, copy cursor, a caller's past n-grams
    planner     how many proposed tokens each sequence checks this step
    costs       what one llama_decode costs, by its shape
    threads     which thread count decodes fastest (each count keeps its own costs)
"""

from backend.llamacpp.speculation.speculator import Speculator
from backend.llamacpp.speculation.threads import ThreadTuner

__all__ = ["Speculator", "ThreadTuner"]
