"""Chat sessions of several turns, each resending its whole history, against one address (a
replica, or Envoy or HAProxy in front of several): the workload prefix-affinity routing is for.

tests/deploy/test_affinity.py and bench/suite/affinity.py share this. Each turn records its prompt and cached
tokens (Usage), its time to first token as the caller sees it, and the replica that served it
(from the replicas' logs: "request <id> finished").
"""

from __future__ import annotations

import concurrent.futures
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from tests.harness.proxies import requests_finished
from tokenspout.affinity import HEADER, affinity_key
from tokenspout.v1 import generation_pb2 as pb
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

TOPICS = ["the sea", "mountains", "bread", "trains", "bees", "rain", "clocks", "maps", "salt", "glass", "owls", "ice"]
QUESTIONS = ["Tell me one fact about it.", "Why is that?", "Give an example.", "What else?", "Say it shorter.",
             "Anything surprising?", "How would you explain it to a child?", "Summarise."]


@dataclass
class Turn:
    session: int
    turn: int
    request_id: str
    outcome: str = "ok"
    """"ok", or the status code's name."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    sent_at: float = 0.0
    """time.monotonic() when the call was sent."""
    replica: int | None = None
    """Index of the replica that served it (None for a failed call)."""


@dataclass
class Run:
    label: str
    turns: list[Turn] = field(default_factory=list)

    def ok(self) -> list[Turn]:
        return [t for t in self.turns if t.outcome == "ok"]

    def failed(self) -> list[Turn]:
        return [t for t in self.turns if t.outcome != "ok"]

    def cache_share(self) -> float:
        """Prompt tokens served from cache / prompt tokens, over every successful turn."""
        ok = self.ok()
        return sum(t.cached_tokens for t in ok) / sum(t.prompt_tokens for t in ok)

    def ttft_median_ms(self) -> float:
        return statistics.median(t.ttft_s for t in self.ok()) * 1000

    def served(self, replicas: int) -> list[int]:
        """Successful turns per replica."""
        return [sum(t.replica == r for t in self.ok()) for r in range(replicas)]

    def spread(self, replicas: int) -> float:
        """The busiest replica's share of the turns over the mean share (1.0: even)."""
        served = self.served(replicas)
        return max(served) / (sum(served) / replicas)

    def summary(self, replicas: int) -> str:
        return (f"{self.label}: cache share {self.cache_share():.3f}, TTFT median {self.ttft_median_ms():.0f} ms, "
                f"turns per replica {self.served(replicas)} (busiest / mean {self.spread(replicas):.2f}), "
                f"{len(self.failed())} failed")


def system_prompt(label: str, session: int) -> str:
    """A system prompt of its own per session and run (the run's label first: no run reuses
    another's cache), long enough that recomputing it shows."""
    topic = TOPICS[session % len(TOPICS)]
    return (f"[{label} #{session}] You are a patient guide who knows a great deal about {topic}. Answer in one short "
            f"sentence, plainly. Stay on the subject of {topic}.")


def run_sessions(
    address: str, label: str, replica_logs: list, sessions: int = 12, turns: int = 6, max_new_tokens: int = 4,
    affinity: bool = True, after_turn: Callable[[Turn], None] | None = None,
) -> Run:
    """`sessions` concurrent chats of `turns` turns each through `address`; a failed turn is
    recorded and the session goes on to its next turn (as a caller retrying would)."""
    run = Run(label)
    lock = threading.Lock()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)

        def session(index: int) -> None:
            history = [pb.ChatMessage(role="system", content=system_prompt(label, index))]
            for number in range(turns):
                question = pb.ChatMessage(role="user", content=QUESTIONS[number % len(QUESTIONS)])
                request = pb.GenerateStreamRequest(
                    request_id=f"{label}-s{index}-t{number}",
                    chat=pb.Chat(messages=[*history, question]),
                    sampling=pb.SamplingParams(temperature=0.0),
                    stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens),
                )
                metadata = ((HEADER, affinity_key(request)),) if affinity else ()
                turn = Turn(index, number, request.request_id, sent_at=time.monotonic())
                text, start = "", time.perf_counter()
                try:
                    for message in stub.GenerateStream(request, timeout=300, metadata=metadata):
                        turn.ttft_s = turn.ttft_s or time.perf_counter() - start
                        text += message.text
                    turn.prompt_tokens = message.finish.usage.prompt_tokens
                    turn.cached_tokens = message.finish.usage.cached_tokens
                    history += [question, pb.ChatMessage(role="assistant", content=text)]
                except grpc.RpcError as error:
                    turn.outcome = error.code().name
                with lock:
                    run.turns.append(turn)
                if after_turn:
                    after_turn(turn)

        with concurrent.futures.ThreadPoolExecutor(sessions) as pool:
            list(pool.map(session, range(sessions)))
    finished = [requests_finished(replica) for replica in replica_logs]
    for turn in run.ok():
        (turn.replica,) = [i for i, ids in enumerate(finished) if turn.request_id in ids]
    return run
