"""A scripted engine for tests of the service: the real worker thread and event plumbing, no model.

`FakeEngine` honours the Engine protocol on backend.worker.EngineWorker, as the real engines do, with
a `ScriptedCore` in place of a model. Each step, every sequence in a slot that is neither paused nor
held takes its next token from a text fixed by its prompt (the same prompt, the same output), and
its endings are the real ones (backend.common.output.SequenceOutput: stop sequences and tokens,
max_new_tokens, the caller's deadline and time limit, UTF-8 held back until complete). What a model
would do differently a test scripts per request id prefix (`FakeEngine.plan`): hold a sequence after
some tokens until released, end it with EOS, or fail it with any ErrorKind. The engine can be paced
(`step_s`, standing in for a model's speed), held between steps while requests gather (`hold_steps`),
and killed (its thread dies, as a bug would).
tests/harness/faults.py --fake-engine serves it from a real `tokenspout serve` process.

The vocabulary is bytes: 0 is BOS, 1 EOS, 2 and 3 the chat markers, 4 + b the byte b; the chat
template and the constraint compiler are the real ones (backend.common.chat, llguidance) over it.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from backend.common.chat import ChatTemplate, RenderedChat, SpecialTokens, tokenize_chat
from backend.common.core import CoreBase
from backend.common.output import ConstraintFailed, SequenceOutput
from backend.common.stats import EngineStats
from backend.config import EngineConfig
from backend.constraints import CompiledConstraint, ConstraintCompiler
from backend.constraints.tokenizer import build_tokenizer
from backend.events import ErrorEvent, ErrorKind, EventSink, FinishReason, GeneratedToken
from backend.local_engine import WorkerEngine
from backend.types import COMMON_SAMPLERS, CONSTRAINT_KINDS, ChatContext, ChatMessage, GenerationRequest, ModelInfo

FAKE_MODEL_ID = "fake-bytes"
BOS, EOS, IM_START, IM_END = 0, 1, 2, 3
SPECIALS = {BOS: b"<s>", EOS: b"</s>", IM_START: b"<|im_start|>", IM_END: b"<|im_end|>"}
BYTE_BASE = len(SPECIALS)
VOCAB_SIZE = BYTE_BASE + 256
EOS_TOKEN_IDS = (EOS, IM_END)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
OUTPUT_TEXT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. "
"""What every sequence generates, from a place its prompt chooses."""


def encode(data: bytes) -> list[int]:
    return [BYTE_BASE + b for b in data]


def piece(token_id: int) -> bytes:
    """What a token decodes to as output (control tokens: nothing)."""
    return bytes([token_id - BYTE_BASE]) if token_id >= BYTE_BASE else b""


def output_text(prompt: Sequence[int]) -> bytes:
    """The text a prompt's sequence generates, repeated as long as it runs."""
    start = sum(prompt) % len(OUTPUT_TEXT)
    return (OUTPUT_TEXT[start:] + OUTPUT_TEXT[:start]).encode()


@dataclass
class Plan:
    """What the fake engine does with the requests whose id starts with a prefix, besides generating."""

    hold_after: int | None = None
    """Stop after this many tokens (the sequence keeps its slot) until FakeEngine.let_go(plan)."""
    eos_after: int | None = None
    """Sample EOS as this token (an ending the caller did not ask for; see the stopping rules)."""
    fail_after: int | None = None
    """Fail with `error` after this many tokens."""
    error: ErrorKind = ErrorKind.ENGINE_FAILURE
    message: str = "scripted failure"
    output: bytes | None = None
    """Generate these bytes (one token each, repeated) instead of OUTPUT_TEXT; with eos_after, a scripted reply."""
    released: threading.Event = field(default_factory=threading.Event, repr=False)

    def holds(self, generated: int) -> bool:
        return self.hold_after is not None and generated >= self.hold_after and not self.released.is_set()


_UNPLANNED = Plan()
"""Every request no plan names shares this one (a Plan per request made a threading.Event per request)."""


@functools.lru_cache(maxsize=256)
def _positions(text: bytes, logprob: float | None) -> tuple[GeneratedToken, ...]:
    """Each position's token, made once per text: per token the fake engine does no more than a model's host
    would (`python -m bench service_ceiling` counts its work as the service's). Shared: a GeneratedToken is a value."""
    return tuple(GeneratedToken(BYTE_BASE + b, bytes([b]), logprob) for b in text)


_EOS_TOKENS = {logprob: GeneratedToken(EOS, b"", logprob) for logprob in (None, 0.0)}


def _hold_the_gil_for(seconds: float) -> None:
    """Pure Python for `seconds` of this thread's CPU time: the GIL held all along, but for the interpreter's own
    switches (another thread asking for it gets it every 5 ms), as a Python engine launching kernels holds it."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        for _ in range(200):
            pass


class FakeSequence:
    def __init__(self, request: GenerationRequest, sink: EventSink, plan: Plan, constraint: CompiledConstraint | None) -> None:
        self.request = request
        self.sink = sink
        self.plan = plan
        self.output = SequenceOutput(request, constraint)
        self.logprob = 0.0 if request.output.return_logprobs else None
        self.tokens = _positions(plan.output or output_text(request.prompt_token_ids), self.logprob)
        self.prompt_length = len(request.prompt_token_ids)
        self.paused_since: float | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def stepping(self) -> bool:
        return self.paused_since is None and not self.plan.holds(self.output.generated)

    @property
    def cells(self) -> int:
        return self.prompt_length + self.output.generated


class ScriptedCore(CoreBase[FakeSequence]):
    """An EngineCore (backend.worker) that steps every running sequence by one scripted token."""

    def __init__(self, config: EngineConfig, plans: dict[str, Plan], step_s: float = 0.0, step_cpu_s: float = 0.0) -> None:
        super().__init__(EngineStats(cache_tokens_total=config.context_length * config.max_batch_size))
        self.context_length = config.context_length
        self.max_batch_size = config.max_batch_size
        self.max_pause_s = config.llamacpp.max_pause_s
        self.step_s = step_s
        self.step_cpu_s = step_cpu_s
        self._paced_until = 0.0
        """When the step in progress is due to end, on a paced engine (see _pace)."""
        self._plans = plans
        self.waiting: collections.deque[FakeSequence] = collections.deque()
        self.running: dict[str, FakeSequence] = {}
        self.dying = False
        self.steps_held = False
        """No step starts while set (commands still apply): FakeEngine.hold_steps."""

    def plan_for(self, request_id: str) -> Plan:
        matches = [prefix for prefix in tuple(self._plans) if request_id.startswith(prefix)]  # tests add plans
        return self._plans[max(matches, key=len)] if matches else _UNPLANNED

    # -- commands --------------------------------------------------------------

    def add(self, request: GenerationRequest, sink: EventSink, constraint: CompiledConstraint | None = None) -> None:
        self.end_leftovers(request.request_id)
        self.waiting.append(FakeSequence(request, sink, self.plan_for(request.request_id), constraint))

    def _group(self, request_id: str) -> list[FakeSequence]:
        seq = self.running.get(request_id) or next((s for s in self.waiting if s.request_id == request_id), None)
        return [seq] if seq is not None else []

    def pause(self, request_id: str) -> None:
        seq = self.running.get(request_id)
        if seq is not None and seq.paused_since is None:
            seq.paused_since = time.monotonic()

    def resume(self, request_id: str) -> None:
        seq = self.running.get(request_id)
        if seq is not None:
            seq.paused_since = None

    def has_work(self) -> bool:
        if self.steps_held:
            return False
        admissible = self.waiting and len(self.running) < self.max_batch_size
        return bool(admissible or any(seq.stepping for seq in self.running.values()))

    def holds_sequences(self) -> bool:
        return bool(self.waiting or self.running)

    def expire(self) -> None:
        self._check_alive()
        self._expire()

    def step(self) -> None:
        self._check_alive()
        if self.step_cpu_s:
            _hold_the_gil_for(self.step_cpu_s)
            time.sleep(self.step_s)  # then the kernels' wait, after it (a step takes both, one after the other)
        elif self.step_s:
            self._pace()
        self.steps += 1
        self._expire()
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting.popleft()
            seq.output.mark_admitted()
            self.ledger.started(seq, len(seq.request.prompt_token_ids))
            self.running[seq.request_id] = seq
        for seq in [s for s in self.running.values() if s.stepping]:
            self._generate(seq)

    def close(self) -> None:
        for seq in [*self.waiting, *self.running.values()]:
            self._end(seq, FinishReason.CANCELLED)

    # -- what a step does for one sequence --------------------------------------

    def _generate(self, seq: FakeSequence) -> None:
        output, plan = seq.output, seq.plan
        if plan.fail_after is not None and output.generated >= plan.fail_after:
            self._fail(seq, plan.message, plan.error)
            return
        if seq.prompt_length + output.generated >= self.context_length:
            self._end(seq, FinishReason.CONTEXT_LIMIT)
            return
        output.step = self.steps
        is_eos = plan.eos_after is not None and output.generated + 1 >= plan.eos_after
        token = _EOS_TOKENS[seq.logprob] if is_eos else seq.tokens[output.generated % len(seq.tokens)]
        try:
            event = output.on_token(token, is_eos)
        except ConstraintFailed as exc:  # its script is not the grammar's: the stream ends as a real core ends it
            self._fail(seq, str(exc), ErrorKind.CONSTRAINT_FAILED)
            return
        if event.tokens:
            self.ledger.generated(seq, len(event.tokens))
        self._emit(seq.sink, event)
        if output.finished:
            self._release(seq)

    def _pace(self) -> None:
        """Waits out the model's time for this step. Steps start on the clock's ticks, step_s apart, so the
        host's work between steps overlaps the model's, as on a GPU the host plans while the device computes
        (one step per step_s while the host keeps up); the first step after a pause waits a whole step."""
        now = time.monotonic()
        due = self._paced_until + self.step_s
        if due < now:  # idle, held, or the host fell behind: a whole step from now
            due = now + self.step_s
        time.sleep(due - now)
        self._paced_until = due

    def _expire(self) -> None:
        now = time.monotonic()
        for seq in [s for s in self.waiting if s.output.deadline_passed(now)]:
            self._end(seq, FinishReason.TIME_LIMIT)
        for seq in list(self.running.values()):
            if seq.output.deadline_passed(now):
                self._end(seq, FinishReason.TIME_LIMIT)
            elif seq.paused_since is not None and now - seq.paused_since >= self.max_pause_s:
                message = f"the caller read nothing for {self.max_pause_s:g} s (max_pause_s)"
                self._fail(seq, message, ErrorKind.PAUSED_TOO_LONG)

    def _check_alive(self) -> None:
        if self.dying:
            raise RuntimeError("the fake engine was killed")

    # -- endings ---------------------------------------------------------------

    def _end(self, seq: FakeSequence, reason: FinishReason) -> None:
        self._emit(seq.sink, seq.output.end(reason))
        self._release(seq)

    def _fail(self, seq: FakeSequence, message: str, kind: ErrorKind) -> None:
        self._emit(seq.sink, ErrorEvent(message, kind))
        self._release(seq)

    def _release(self, seq: FakeSequence) -> None:
        if self.running.get(seq.request_id) is seq:
            del self.running[seq.request_id]
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _settle(self) -> None:
        running = self.running.values()
        self.stats = self.ledger.snapshot(
            running, self.waiting, (),
            steps=self.steps,
            running_sequences=len(running),
            paused_sequences=sum(seq.paused_since is not None for seq in running),
            queued_requests=len(self.waiting),
            cache_tokens_used=sum(seq.cells for seq in running),
            cache_tokens_total=self.context_length * self.max_batch_size,
        )


class FakeVocabulary:
    """The fake model's vocabulary (backend.engine.Vocabulary): bytes, and the real chat template code over them."""

    def __init__(self) -> None:
        self._chat = ChatTemplate(CHAT_TEMPLATE, "<s>", "</s>")
        self._specials = SpecialTokens((text.decode(), token) for token, text in SPECIALS.items())

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return [BOS, *encode(text.encode())] if add_special else encode(text.encode())

    def token_piece(self, token_id: int) -> bytes:
        return piece(token_id)

    def render_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, special_tokens_in_content: bool = False,
        context: ChatContext = ChatContext(),
    ) -> list[int]:
        plain = lambda text: encode(text.encode())  # noqa: E731
        if special_tokens_in_content:  # every special token's text is that token, the callers' too
            chat = RenderedChat(self._chat.render(messages, add_generation_prompt, context), content_spans=())
            return tokenize_chat(chat, messages, self._specials, plain)
        return tokenize_chat(self._chat.render_marked(messages, add_generation_prompt, context), messages, self._specials, plain)


class FakeEngine(WorkerEngine):
    """The Engine protocol over a ScriptedCore on a real EngineWorker thread."""

    def __init__(self, config: EngineConfig = EngineConfig(), step_s: float = 0.0, step_cpu_s: float = 0.0) -> None:
        """`step_s`: seconds each step waits with the GIL released (a kernel's wait); `step_cpu_s`: seconds of pure
        Python before it, holding the GIL (as exllamav2's own Python does launching a step's kernels)."""
        self._plans: dict[str, Plan] = {}
        self.core = ScriptedCore(config, self._plans, step_s, step_cpu_s)
        self.info = ModelInfo(
            model_id=config.model_id or FAKE_MODEL_ID,
            engine="fake",
            context_length=config.context_length,
            vocab_size=VOCAB_SIZE,
            max_batch_size=config.max_batch_size,
            bos_token_id=BOS,
            eos_token_ids=EOS_TOKEN_IDS,
            has_chat_template=True,
            samplers=COMMON_SAMPLERS,
            constraint_kinds=CONSTRAINT_KINDS,
        )
        pieces = [SPECIALS.get(t) or piece(t) for t in range(VOCAB_SIZE)]
        tokenizer = build_tokenizer(pieces, list(SPECIALS), EOS_TOKEN_IDS, BOS, encode)
        self.vocabulary = FakeVocabulary()
        self._serve(self.core, ConstraintCompiler(tokenizer, limits=config.constraint), config, name="fake-engine")

    # -- the script ------------------------------------------------------------

    def plan(self, prefix: str, **what) -> Plan:
        """What happens to requests whose id starts with `prefix` (the longest matching prefix wins)."""
        plan = self._plans[prefix] = Plan(**what)
        return plan

    def let_go(self, plan: Plan) -> None:
        """Lets held sequences of this plan go on (and wakes the engine thread to step them)."""
        plan.released.set()
        self._worker.resume("")

    def hold_steps(self) -> None:
        """No step starts until run_steps(): requests sent meanwhile queue, and start at the same step."""
        self.core.steps_held = True

    def run_steps(self) -> None:
        """Steps go on (and the engine thread wakes to take them)."""
        self.core.steps_held = False
        self._worker.resume("")

    def pace(self, step_s: float) -> None:
        """Seconds each step takes from now on (0: as fast as the callers read)."""
        self.core.step_s = step_s

    def kill(self) -> None:
        """The engine thread dies at its next turn, as a bug in its loop would (the server's ENGINE_DOWN)."""
        self.core.dying = True
        self._worker.resume("")  # wakes the thread if it waits for commands

    def close(self) -> None:
        self._stop()

