"""The two kinds of short prompt the first-token benchmarks time against llama-server at its defaults
(`cache_prompt` on): prompts that share nothing with any other (each begins with a token no other begins
with, so neither server finds any of it cached), and prompts that extend the one sent just before by a few
words (a caller refining what it asked, a templated caller's next request)."""

from __future__ import annotations

import random

from backend import EngineConfig, build_engine

TOPICS = [
    "how do volcanoes form?",
    "why do cats purr?",
    "explain photosynthesis to a child.",
    "what are the rules of chess?",
    "write a short poem about the sea.",
    "what is the history of the printing press?",
    "how is bread made?",
    "which planets have rings?",
]
EXTENSIONS = [
    " Answer in one sentence.",
    " Explain it simply, please.",
    " Give one example of it.",
    " Keep the answer short.",
]


def fresh_prompts(count: int, seed: int | None = None) -> list[str]:
    """`count` short prompts (18-22 tokens), each beginning with a word that is one token and begins no other."""
    engine = build_engine(EngineConfig.of(context_length=256, max_batch_size=1))
    try:
        pieces = (engine.token_piece(token) for token in range(engine.info.vocab_size))
        words = [piece.decode() for piece in pieces
                 if piece.isascii() and piece.isalpha() and piece[:1].isupper() and 4 <= len(piece) <= 10]
        random.Random(seed).shuffle(words)
        prompts: list[str] = []
        firsts: set[int] = set()
        for word in words:
            prompt = f"{word} asks: {TOPICS[len(prompts) % len(TOPICS)]} Write for a reader who knows little about it."
            first = engine.tokenize(prompt, add_special=False)[0]
            if first not in firsts:
                firsts.add(first)
                prompts.append(prompt)
                if len(prompts) == count:
                    return prompts
    finally:
        engine.close()
    raise ValueError(f"the vocabulary has fewer than {count} words that begin a prompt with a token of their own")


def clauses(tag: object) -> str:
    """A prompt of about 400 tokens, 25 clauses of a contract named by `tag`: its own for each tag (no other
    tag's is a prefix of it), so a server has none of it cached."""
    return " ".join(f"Clause {i} of contract {tag}: the tenant keeps the garden tidy." for i in range(25))


def extended(prompt: str, index: int) -> str:
    """The prompt and a few more words (4-6 tokens)."""
    return prompt + EXTENSIONS[index % len(EXTENSIONS)]
