"""Validation at the edge: a protobuf request in, a neutral GenerationRequest out.

Everything is checked here so that the engine never sees a request it cannot
serve. Field problems are collected and reported together as BadRequest
violations; state-dependent ones (a prompt longer than the context) are
OUT_OF_RANGE; a model this server does not serve is NOT_FOUND.
"""

from __future__ import annotations

import math
import secrets
import uuid
from dataclasses import dataclass

from backend import (
    DEFAULT_DRY_BREAKERS, MAX_DRAFT_TOKENS, ChatMessage, ChatTemplateError, DryParams, Engine, GenerationRequest,
    MirostatParams, OutputParams, SamplingParams, SpeculationParams, StopParams, XtcParams, common_prefix,
)
from backend.constraints import ConstraintSpec
from service.convert import SPECULATION_MODES
from service.truncation import truncated_chat
from service.errors import FieldViolation, invalid_argument, not_found_model, out_of_range, unimplemented
from tokenspout.v1 import generation_pb2 as pb

MAX_SEED = 2**32 - 2  # llama.cpp reserves 2**32 - 1 for "random"
_SPECULATION_MODES = {number: mode for mode, number in SPECULATION_MODES.items()}
DEFAULT_MAX_NEW_TOKENS = 256
_SHOWN_BAD_IDS = 8


@dataclass(frozen=True)
class Limits:
    max_stop_sequences: int = 16
    max_stop_sequence_length: int = 256
    max_top_logprobs: int = 20
    max_logit_bias_entries: int = 1024
    max_request_id_length: int = 128
    max_choices: int = 1024
    max_constraint_chars: int = 1_000_000
    max_input_bytes: int = 1 << 20
    """A prompt, a chat's contents together, or Tokenize text (UTF-8); more is INVALID_ARGUMENT."""
    max_banned_strings: int = 64
    max_banned_string_length: int = 256
    max_dry_breakers: int = 16
    max_dry_breaker_length: int = 32
    max_samples: int = 16
    """Most samples (n) one request may ask for."""
    max_tokenize_texts: int = 64
    """Most texts one Tokenize call may carry (TokenizeRequest.texts)."""


class RequestValidator:
    def __init__(
        self,
        engine: Engine,
        limits: Limits = Limits(),
        model_names: tuple[str, ...] = (),
        special_tokens_in_chat_content: bool = False,
    ) -> None:
        self._engine = engine
        self._special_tokens_in_chat_content = special_tokens_in_chat_content
        self._info = engine.info
        self.limits = limits
        self._model_names = {"", "default", self._info.model_id, *model_names}

    def check_model(self, model: str) -> None:
        if model not in self._model_names:
            raise not_found_model(model)

    def generation_request(self, request: pb.GenerateStreamRequest) -> tuple[GenerationRequest, ConstraintSpec | None]:
        """The request as the engine takes it, less its compiled constraint, and that constraint's spec.

        Raises ServiceError for anything the engine could not serve as asked. Tokenizes the
        input (see `input_bytes`: call it from a worker thread when the input is large); the
        caller compiles the constraint (see service.compiles).
        """
        self.check_model(request.model)
        violations: list[FieldViolation] = []
        constraint = None
        if request.HasField("constraint"):
            if request.stopping.ignore_eos:
                violations.append(FieldViolation("stopping.ignore_eos", "cannot be used with a constraint"))
            constraint = self.constraint_spec(request.constraint, violations)
        if len(request.request_id) > self.limits.max_request_id_length or not _printable_ascii(request.request_id):
            violations.append(
                FieldViolation("request_id", f"printable ASCII, at most {self.limits.max_request_id_length} characters")
            )
        sampling = self._sampling(request.sampling, violations)
        stopping = self._stopping(request.stopping, violations)
        output = self._output(request.output, violations)
        speculation = self._speculation(request.speculation, violations)
        if request.WhichOneof("input") is None:
            violations.append(FieldViolation("prompt", "set prompt, chat or prompt_token_ids"))
        elif request.HasField("prompt") and not request.prompt:
            violations.append(FieldViolation("prompt", "must not be empty"))
        elif request.HasField("chat"):
            violations.extend(_chat_violations(request.chat))
        elif request.HasField("prompt_token_ids"):
            violations.extend(self._token_id_violations(request.prompt_token_ids.ids))
        if constraint is not None:
            for name in ("banned_strings", "token_healing"):
                if getattr(sampling, name):
                    violations.append(FieldViolation(f"sampling.{name}", "cannot be used with a constraint"))
        if request.n > self.limits.max_samples:
            violations.append(FieldViolation("n", f"at most {self.limits.max_samples} samples"))
        if request.output.prompt_top_logprobs > self.limits.max_top_logprobs:
            violations.append(FieldViolation("output.prompt_top_logprobs", f"at most {self.limits.max_top_logprobs}"))
        if violations:
            raise invalid_argument(violations)
        self._refuse_unsupported(sampling, speculation)
        self._refuse_unsupported_features(request)
        prompt, kept_messages, truncated = self._prompt(request)
        problem = self._engine.budget_problem(len(prompt), stopping.max_new_tokens)
        if problem:
            raise out_of_range("stopping.max_new_tokens", problem)
        return GenerationRequest(
            request_id=request.request_id or uuid.uuid4().hex,
            prompt_token_ids=tuple(prompt),
            sampling=sampling,
            stopping=stopping,
            output=output,
            speculation=speculation,
            last_message_start=self._last_message_start(kept_messages, prompt),
            truncated_tokens=truncated,
            sample_seeds=_sample_seeds(request, sampling) if request.n > 1 else (),
            prompt_logprobs=request.output.prompt_top_logprobs if _wants_prompt_logprobs(request) else -1,
        ), constraint

    def constraint_spec(self, c: pb.Constraint, violations: list[FieldViolation]) -> ConstraintSpec | None:
        """The neutral form of a constraint; shape problems are added to `violations`."""
        kind = c.WhichOneof("kind")
        value: str | tuple[str, ...] = ""
        if kind is None:
            violations.append(FieldViolation("constraint", "set one of json_schema, json_object, regex, grammar, choice"))
            return None
        if kind == "choice":
            value = tuple(c.choice.values)
            if not value or len(value) > self.limits.max_choices or not all(value):
                violations.append(
                    FieldViolation("constraint.choice.values", f"1 to {self.limits.max_choices} non-empty strings")
                )
        elif kind == "json_object":
            if not c.json_object:
                violations.append(FieldViolation("constraint.json_object", "must be true when set"))
        else:
            value = getattr(c, kind)
            if not value:
                violations.append(FieldViolation(f"constraint.{kind}", "must not be empty"))
        size = sum(map(len, value)) if kind == "choice" else len(value)
        if size > self.limits.max_constraint_chars:
            violations.append(FieldViolation(f"constraint.{kind}", f"at most {self.limits.max_constraint_chars} characters"))
        if (c.whitespace_flexible or c.HasField("max_whitespace")) and kind not in ("json_schema", "json_object"):
            violations.append(FieldViolation("constraint.whitespace_flexible", "applies to JSON constraints only"))
        return ConstraintSpec(
            kind=kind,
            value=value,
            strict=c.strict if c.HasField("strict") else True,
            whitespace_flexible=c.whitespace_flexible,
            max_whitespace=c.max_whitespace if c.HasField("max_whitespace") else None,
        )

    def check_tokenize(self, request: pb.TokenizeRequest) -> None:
        """Raises INVALID_ARGUMENT for a Tokenize call of a shape it cannot answer."""
        texts = request.texts
        violations = []
        if texts and request.WhichOneof("input") is not None:
            violations.append(FieldViolation("texts", f"send texts or {request.WhichOneof('input')}, not both"))
        if len(texts) > self.limits.max_tokenize_texts:
            violations.append(FieldViolation("texts", f"{len(texts)} texts; at most {self.limits.max_tokenize_texts}"))
        if request.return_offsets and request.HasField("chat"):
            violations.append(FieldViolation("return_offsets", "offsets are for text input, not a chat"))
        size = input_bytes(request)
        if size > self.limits.max_input_bytes:
            violations.append(FieldViolation("texts" if texts else "text",
                                             f"{size} bytes; at most {self.limits.max_input_bytes}"))
        if violations:
            raise invalid_argument(violations)

    def tokenize_texts(self, request: pb.TokenizeRequest) -> list[tuple[bytes, list[int]]]:
        """Each text of a checked Tokenize call (`texts`, else its one text) as UTF-8 with its tokens."""
        texts = list(request.texts)
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        return [
            (data, self._engine.tokenize(text, add_special=add_special))
            for text, data in ((text, text.encode()) for text in (texts or [request.text]))
        ]

    def _token_id_violations(self, ids) -> list[FieldViolation]:
        """Ids outside the vocabulary, the first few by place, then how many more (an error stays small)."""
        if not ids:
            return [FieldViolation("prompt_token_ids.ids", "must not be empty")]
        vocab_size = self._info.vocab_size
        bad = [i for i, token in enumerate(ids) if not 0 <= token < vocab_size]
        violations = [
            FieldViolation(f"prompt_token_ids.ids[{i}]", f"{ids[i]} is not a token id of this model (0 to {vocab_size - 1})")
            for i in bad[:_SHOWN_BAD_IDS]
        ]
        if len(bad) > _SHOWN_BAD_IDS:
            violations.append(FieldViolation("prompt_token_ids.ids", f"and {len(bad) - _SHOWN_BAD_IDS} more bad ids"))
        return violations

    def prompt_tokens(self, request: pb.GenerateStreamRequest | pb.TokenizeRequest) -> list[int]:
        """Tokenizes the prompt or renders the chat, checking its size and that it fits the context."""
        return self._prompt(request)[0]

    def _prompt(
        self, request: pb.GenerateStreamRequest | pb.TokenizeRequest
    ) -> tuple[list[int], list[ChatMessage], int]:
        """The prompt's tokens (truncated as the request asks), for a chat the messages they hold, and how
        many tokens truncation dropped."""
        truncated = 0
        field_name = request.WhichOneof("input")
        size = input_bytes(request)
        if size > self.limits.max_input_bytes:
            where = field_name or "text"
            raise invalid_argument([FieldViolation(where, f"{size} bytes; at most {self.limits.max_input_bytes}")])
        keep = request.truncate_input_tokens if isinstance(request, pb.GenerateStreamRequest) else 0
        messages: list[ChatMessage] = []
        if field_name == "chat":
            messages = [ChatMessage(m.role, m.content) for m in request.chat.messages]
            add_prompt = request.chat.add_generation_prompt if request.chat.HasField("add_generation_prompt") else True
            # ChatTemplateError: the caller's input
            render = lambda kept: self._engine.render_chat(kept, add_prompt, self._special_tokens_in_chat_content)  # noqa: E731
            tokens = render(messages)
            if keep and len(tokens) > keep:
                full = len(tokens)
                messages, tokens = truncated_chat(messages, tokens, keep, render)
                truncated = full - len(tokens)
        elif field_name == "prompt_token_ids":
            tokens = list(request.prompt_token_ids.ids)  # as given: the caller decides on BOS
        else:
            text = request.prompt if isinstance(request, pb.GenerateStreamRequest) else request.text
            add_special = True
            if isinstance(request, pb.TokenizeRequest) and request.HasField("add_special_tokens"):
                add_special = request.add_special_tokens
            tokens = self._engine.tokenize(text, add_special=add_special)
        if field_name != "chat" and keep and len(tokens) > keep:
            truncated = len(tokens) - keep
            tokens = tokens[-keep:]
        if isinstance(request, pb.GenerateStreamRequest) and not tokens:
            raise invalid_argument([FieldViolation(field_name, "tokenizes to nothing")])
        limit = self._info.context_length
        if isinstance(request, pb.GenerateStreamRequest) and len(tokens) >= limit:
            raise out_of_range(
                field_name, f"{len(tokens)} prompt tokens leave no room in the {limit}-token context"
            )
        return tokens, messages, truncated

    def _last_message_start(self, messages: list[ChatMessage], prompt: list[int]) -> int:
        """Where a chat's last message begins in its tokens: the history before it renders to their prefix."""
        if len(messages) < 2:
            return 0
        history = messages[:-1]
        try:
            before = self._engine.render_chat(history, False, self._special_tokens_in_chat_content)
        except ChatTemplateError:  # a template may refuse a history on its own (e.g. ending with the system)
            return 0
        return common_prefix(before, prompt)

    def _sampling(self, s: pb.SamplingParams, violations: list[FieldViolation]) -> SamplingParams:
        check = _RangeChecker("sampling", s, violations)
        check.range("temperature", 0.0, 100.0)
        check.range("top_k", 0, self._info.vocab_size)
        check.range("top_p", 0.0, 1.0, low_open=True)
        check.range("min_p", 0.0, 1.0)
        check.range("typical_p", 0.0, 1.0, low_open=True)
        check.range("repetition_penalty", 0.0, 10.0, low_open=True)
        check.range("presence_penalty", -2.0, 2.0)
        check.range("frequency_penalty", -2.0, 2.0)
        check.range("penalty_last_n", 0, self._info.context_length)
        check.range("seed", 0, MAX_SEED)
        if len(s.logit_bias) > self.limits.max_logit_bias_entries:
            violations.append(
                FieldViolation("sampling.logit_bias", f"at most {self.limits.max_logit_bias_entries} entries")
            )
        for token, bias in s.logit_bias.items():
            if not 0 <= token < self._info.vocab_size:
                violations.append(FieldViolation(f"sampling.logit_bias[{token}]", "not a token id of this model"))
            elif not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                violations.append(FieldViolation(f"sampling.logit_bias[{token}]", "bias must be in [-100, 100]"))
        check.range("top_a", 0.0, 1.0)
        check.range("tfs", 0.0, 1.0, low_open=True)
        check.range("skew", -5.0, 5.0)
        check.range("smoothing_factor", 0.0, 10.0)
        violations.extend(
            self._listed_strings(
                "sampling.banned_strings", s.banned_strings,
                self.limits.max_banned_strings, self.limits.max_banned_string_length,
            )
        )
        params = check.values()
        temperature = params.get("temperature", 1.0)
        if "seed" not in params:
            params["seed"] = 0 if temperature == 0.0 else secrets.randbelow(MAX_SEED + 1)
        xtc = _checked(s.xtc, "sampling.xtc", violations, probability=(0.0, 1.0), threshold=(0.0, 0.5))
        mirostat = _checked(s.mirostat, "sampling.mirostat", violations, tau=(0.0, 20.0, True), eta=(0.0, 1.0, True))
        return SamplingParams(
            **params,
            logit_bias=dict(s.logit_bias),
            dry=self._dry(s.dry, violations),
            xtc=XtcParams(**xtc),
            mirostat=MirostatParams(**mirostat) if s.HasField("mirostat") else None,
            banned_strings=tuple(s.banned_strings),
            token_healing=s.token_healing,
        )

    def _dry(self, d: pb.DrySampler, violations: list[FieldViolation]) -> DryParams:
        params = _checked(
            d, "sampling.dry", violations, multiplier=(0.0, 10.0), base=(1.0, 10.0, True), allowed_length=(1, 64),
            penalty_last_n=(0, self._info.context_length),
        )
        if params.get("penalty_last_n") == 1:
            violations.append(FieldViolation("sampling.dry.penalty_last_n", "must be 0 (whole context) or at least 2"))
        violations.extend(
            self._listed_strings(
                "sampling.dry.sequence_breakers", d.sequence_breakers,
                self.limits.max_dry_breakers, self.limits.max_dry_breaker_length,
            )
        )
        if "penalty_last_n" in params:
            params["last_n"] = params.pop("penalty_last_n")
        return DryParams(**params, sequence_breakers=tuple(d.sequence_breakers) or DEFAULT_DRY_BREAKERS)

    @staticmethod
    def _listed_strings(name: str, values, most: int, longest: int) -> list[FieldViolation]:
        """Checks a repeated string field: at most `most` entries of 1 to `longest` characters."""
        if len(values) > most:
            return [FieldViolation(name, f"at most {most}")]
        return [
            FieldViolation(f"{name}[{i}]", f"must have 1 to {longest} characters")
            for i, value in enumerate(values)
            if not 0 < len(value) <= longest
        ]

    def _refuse_unsupported(self, sampling: SamplingParams, speculation: SpeculationParams) -> None:
        """Raises UNIMPLEMENTED, naming every one, when the request turns on what this engine lacks."""
        missing = sorted(sampling.in_effect() - set(self._info.samplers))
        description = "this engine has no such sampler; GetModelInfo.samplers lists the ones it has"
        violations = [FieldViolation(f"sampling.{name}", description) for name in missing]
        if speculation.mode not in self._info.speculation_modes:
            modes = ", ".join(mode.value for mode in self._info.speculation_modes)
            violations.append(FieldViolation("speculation.mode", f"this engine serves only {modes} here"))
        if not self._info.draft_tokens_per_request and speculation != self._info.default_speculation:
            violations.append(FieldViolation("speculation.max_draft_tokens", "set by the server alone on this engine"))
        if violations:
            raise unimplemented(violations)

    def _refuse_unsupported_features(self, request: pb.GenerateStreamRequest) -> None:
        """UNIMPLEMENTED, naming each field, for the request options this engine lacks."""
        asked = {
            "prompt_token_ids": request.HasField("prompt_token_ids"),
            "n": request.n > 1,
            "truncate_input_tokens": request.truncate_input_tokens > 0,
            "output.prompt_logprobs": _wants_prompt_logprobs(request),
        }
        missing = [name for name, on in asked.items() if on and name not in self._info.request_features]
        if missing:
            description = "this engine cannot serve it; GetModelInfo.request_features lists what it can"
            raise unimplemented([FieldViolation(name, description) for name in missing])

    def _speculation(self, s: pb.Speculation, violations: list[FieldViolation]) -> SpeculationParams:
        default = self._info.default_speculation
        if s.max_draft_tokens > MAX_DRAFT_TOKENS:
            violations.append(FieldViolation("speculation.max_draft_tokens", f"at most {MAX_DRAFT_TOKENS}"))
        mode = _SPECULATION_MODES.get(s.mode)
        if mode is None and s.mode != pb.SPECULATION_MODE_UNSPECIFIED:
            violations.append(FieldViolation("speculation.mode", "unknown mode"))
        return SpeculationParams(mode or default.mode, s.max_draft_tokens or default.max_draft_tokens)

    def _stopping(self, s: pb.StoppingCriteria, violations: list[FieldViolation]) -> StopParams:
        check = _RangeChecker("stopping", s, violations)
        check.range("max_new_tokens", 1, self._info.context_length)
        check.range("min_new_tokens", 0, self._info.context_length)
        params = check.values()
        max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if params.get("min_new_tokens", 0) > max_new:
            violations.append(FieldViolation("stopping.min_new_tokens", "must be at most max_new_tokens"))
        violations.extend(
            self._listed_strings(
                "stopping.stop_sequences", s.stop_sequences,
                self.limits.max_stop_sequences, self.limits.max_stop_sequence_length,
            )
        )
        for i, token in enumerate(s.stop_token_ids):
            if not 0 <= token < self._info.vocab_size:
                violations.append(FieldViolation(f"stopping.stop_token_ids[{i}]", "not a token id of this model"))
        return StopParams(
            max_new_tokens=max_new,
            min_new_tokens=params.get("min_new_tokens", 0),
            stop_sequences=tuple(s.stop_sequences),
            stop_token_ids=frozenset(s.stop_token_ids),
            include_stop_sequence=s.include_stop_sequence,
            ignore_eos=s.ignore_eos,
            time_limit_s=s.time_limit_ms / 1000 if s.time_limit_ms else None,
        )

    def _output(self, o: pb.OutputOptions, violations: list[FieldViolation]) -> OutputParams:
        if o.top_logprobs > self.limits.max_top_logprobs:
            violations.append(FieldViolation("output.top_logprobs", f"at most {self.limits.max_top_logprobs}"))
        return OutputParams(
            return_tokens=o.return_token_ids or o.return_logprobs or o.top_logprobs > 0,
            return_logprobs=o.return_logprobs,
            top_logprobs=o.top_logprobs,
        )


class _RangeChecker:
    """Checks the `optional` scalar fields of one message and collects the set ones."""

    def __init__(self, prefix: str, message, violations: list[FieldViolation]) -> None:
        self._prefix = prefix
        self._message = message
        self._violations = violations
        self._values: dict[str, float | int] = {}

    def range(self, name: str, low: float, high: float, low_open: bool = False) -> None:
        if not self._message.HasField(name):
            return
        value = getattr(self._message, name)
        in_range = (low < value if low_open else low <= value) and value <= high
        if isinstance(value, float) and not math.isfinite(value) or not in_range:
            bracket = "(" if low_open else "["
            self._violations.append(FieldViolation(f"{self._prefix}.{name}", f"must be in {bracket}{low}, {high}]"))
        else:
            self._values[name] = value

    def values(self) -> dict[str, float | int]:
        return dict(self._values)


def _checked(message, prefix: str, violations: list[FieldViolation], **ranges: tuple) -> dict[str, float | int]:
    """The set fields of a small message, each checked against its (low, high[, low_open]) range."""
    check = _RangeChecker(prefix, message, violations)
    for name, bounds in ranges.items():
        check.range(name, *bounds)
    return check.values()


def _wants_prompt_logprobs(request: pb.GenerateStreamRequest) -> bool:
    return request.output.prompt_logprobs or request.output.prompt_top_logprobs > 0


def _sample_seeds(request: pb.GenerateStreamRequest, sampling: SamplingParams) -> tuple[int, ...]:
    """Each sample's seed: the request's seed + the sample's index when it gave one, else random (0: greedy)."""
    if sampling.greedy:
        return (0,) * request.n
    if request.sampling.HasField("seed"):
        return tuple((sampling.seed + i) % (MAX_SEED + 1) for i in range(request.n))
    return (sampling.seed, *(secrets.randbelow(MAX_SEED + 1) for _ in range(request.n - 1)))


def _printable_ascii(text: str) -> bool:
    """Request ids go into logs and metadata: no control characters, no line breaks."""
    return all(" " <= c <= "~" for c in text)


def input_bytes(request: pb.GenerateStreamRequest | pb.TokenizeRequest) -> int:
    """The size of what a request asks to tokenize, as UTF-8 (what the wire carried)."""
    if request.WhichOneof("input") == "chat":
        return sum(len(m.content.encode()) + len(m.role.encode()) for m in request.chat.messages)
    if isinstance(request, pb.TokenizeRequest):
        return len(request.text.encode()) + sum(len(text.encode()) for text in request.texts)
    if request.WhichOneof("input") == "prompt_token_ids":
        return 4 * len(request.prompt_token_ids.ids)  # checking them is the work, a few bytes each
    return len(request.prompt.encode())


def _chat_violations(chat: pb.Chat) -> list[FieldViolation]:
    if not chat.messages:
        return [FieldViolation("chat.messages", "must not be empty")]
    return [
        FieldViolation(f"chat.messages[{i}].role", "must not be empty")
        for i, message in enumerate(chat.messages)
        if not message.role
    ]
