"""Checks at the edge: a protobuf request in, the engine's parameters out, or every problem at once.

Pure: it reads what the model is (ModelInfo) and the limits, and never calls the engine (tokenizing and
chat rendering are service.prompt's). Field problems are collected and reported together as BadRequest
violations (INVALID_ARGUMENT); options this engine lacks are UNIMPLEMENTED; a model this server does
not serve is NOT_FOUND. The sampling fields are checked in service.sampling_checks.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from backend import (
    MAX_DRAFT_TOKENS,
    ModelInfo,
    OutputParams,
    SamplingParams,
    SpeculationMode,
    SpeculationParams,
    StopParams,
)
from backend.constraints import ConstraintSpec
from service.chat import ChatFormats, ChatTurn, chat_bytes, check_chat
from service.errors import FieldViolation, invalid_argument, not_found_model, unimplemented
from service.fields import RangeChecker, listed_strings, printable_ascii
from service.limits import Limits
from service.sampling_checks import sample_seeds, sampling_params
from tokenspout.v1 import generation_pb2 as pb

# The proto's number of each mode (SPECULATION_MODE_<NAME>), as service.convert writes them back.
_SPECULATION_MODES = {pb.SpeculationMode.Value(f"SPECULATION_MODE_{mode.name}"): mode for mode in SpeculationMode}
DEFAULT_MAX_NEW_TOKENS = 256
_SHOWN_BAD_IDS = 8


@dataclass(frozen=True)
class RequestParams:
    """A checked GenerateStreamRequest: what the engine's request takes from it, less the prompt (see
    service.prompt), the compiled constraint (service.compiles) and who it is for (service.call)."""

    request_id: str
    sampling: SamplingParams
    stopping: StopParams
    output: OutputParams
    speculation: SpeculationParams
    constraint: ConstraintSpec | None
    sample_seeds: tuple[int, ...]
    prompt_logprobs: int
    queue_timeout_s: float | None
    cache_salt: str = ""
    """The caller's salt as it sent it (service.cache_scope mixes in who the caller is)."""
    chat: ChatTurn | None = None
    """A chat's turn, checked (None for other inputs); service.prompt completes it."""


class RequestValidator:
    def __init__(
        self, info: ModelInfo, limits: Limits = Limits(), model_names: tuple[str, ...] = (),
        formats: ChatFormats | None = None,
    ) -> None:
        self._info = info
        self.limits = limits
        self.formats = formats or ChatFormats.resolve(info)
        self._model_names = {"", "default", info.model_id, *model_names}

    def check_model(self, model: str) -> None:
        if model not in self._model_names:
            raise not_found_model(model)

    def check_samples(self, request: pb.GenerateStreamRequest) -> int:
        """The places the request's samples (n) take at the door; INVALID_ARGUMENT past the most one may ask for."""
        if request.n > self.limits.max_samples:
            raise invalid_argument([FieldViolation("n", f"at most {self.limits.max_samples} samples")])
        return max(1, request.n)

    def params(self, request: pb.GenerateStreamRequest) -> RequestParams:
        """The request's settings as the engine takes them (its samples were checked at the door).

        Raises NOT_FOUND for another model, INVALID_ARGUMENT naming every field problem at once, then
        UNIMPLEMENTED for what this engine lacks.
        """
        self.check_model(request.model)
        violations: list[FieldViolation] = []
        constraint = None
        if request.HasField("constraint"):
            if request.stopping.ignore_eos:
                violations.append(FieldViolation("stopping.ignore_eos", "cannot be used with a constraint"))
            constraint = self.constraint_spec(request.constraint, violations)
        if len(request.request_id) > self.limits.max_request_id_length or not printable_ascii(request.request_id):
            violations.append(
                FieldViolation("request_id", f"printable ASCII, at most {self.limits.max_request_id_length} characters")
            )
        if len(request.cache_salt) > self.limits.max_cache_salt_length:
            violations.append(FieldViolation("cache_salt", f"at most {self.limits.max_cache_salt_length} characters"))
        sampling = sampling_params(request.sampling, self._info, self.limits, violations)
        stopping = self._stopping(request.stopping, violations)
        output = self._output(request.output, violations)
        speculation = self._speculation(request.speculation, violations)
        violations.extend(self._input_violations(request))
        chat = self.chat_turn(request.chat, constraint, violations) if request.HasField("chat") else None
        if constraint is not None:
            for name in ("banned_strings", "token_healing"):
                if getattr(sampling, name):
                    violations.append(FieldViolation(f"sampling.{name}", "cannot be used with a constraint"))
        if request.output.prompt_top_logprobs > self.limits.max_top_logprobs:
            violations.append(FieldViolation("output.prompt_top_logprobs", f"at most {self.limits.max_top_logprobs}"))
        if violations:
            raise invalid_argument(violations)
        self._refuse_unsupported(sampling, speculation)
        self._refuse_unsupported_features(request)
        return RequestParams(
            request_id=request.request_id or uuid.uuid4().hex,
            sampling=sampling,
            stopping=stopping,
            output=output,
            speculation=speculation,
            constraint=constraint,
            sample_seeds=sample_seeds(request, sampling) if request.n > 1 else (),
            prompt_logprobs=request.output.prompt_top_logprobs if _wants_prompt_logprobs(request) else -1,
            queue_timeout_s=request.queue_timeout_ms / 1000 if request.queue_timeout_ms else None,
            cache_salt=request.cache_salt,
            chat=chat,
        )

    def chat_turn(
        self, chat: pb.Chat, constraint: ConstraintSpec | None, violations: list[FieldViolation],
    ) -> ChatTurn:
        """A chat's tools, tool choice, history and reasoning, checked, with the caller's constraint (see
        service.chat); a tool's schema is bounded as a constraint is."""
        return check_chat(chat, self.formats, constraint, self.limits.max_constraint_chars, violations)

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

    def check_tokenize(self, request: pb.TokenizeRequest) -> ChatTurn | None:
        """A Tokenize call's chat turn, checked as a generation's is (None for text); raises INVALID_ARGUMENT for
        a call of a shape it cannot answer."""
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
        if not request.HasField("chat"):
            return None
        turn = self.chat_turn(request.chat, None, violations)
        if violations:
            raise invalid_argument(violations)
        return turn

    def _input_violations(self, request: pb.GenerateStreamRequest) -> list[FieldViolation]:
        """The input's shape (its size and tokens are service.prompt's)."""
        if request.WhichOneof("input") is None:
            return [FieldViolation("prompt", "set prompt, chat or prompt_token_ids")]
        if request.HasField("prompt") and not request.prompt:
            return [FieldViolation("prompt", "must not be empty")]
        if request.HasField("chat"):
            return _chat_violations(request.chat)
        if request.HasField("prompt_token_ids"):
            return self._token_id_violations(request.prompt_token_ids.ids)
        return []

    def _token_id_violations(self, ids: Sequence[int]) -> list[FieldViolation]:
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
            "cache_salt": bool(request.cache_salt),
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
        check = RangeChecker("stopping", s, violations)
        check.range("max_new_tokens", 1, self._info.context_length)
        check.range("min_new_tokens", 0, self._info.context_length)
        max_new = check.integer("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        min_new = check.integer("min_new_tokens", 0)
        if min_new > max_new:
            violations.append(FieldViolation("stopping.min_new_tokens", "must be at most max_new_tokens"))
        violations.extend(listed_strings("stopping.stop_sequences", s.stop_sequences, self.limits.max_stop_sequences,
                                          self.limits.max_stop_sequence_length))
        for i, token in enumerate(s.stop_token_ids):
            if not 0 <= token < self._info.vocab_size:
                violations.append(FieldViolation(f"stopping.stop_token_ids[{i}]", "not a token id of this model"))
        return StopParams(
            max_new_tokens=max_new,
            min_new_tokens=min_new,
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


def _wants_prompt_logprobs(request: pb.GenerateStreamRequest) -> bool:
    return request.output.prompt_logprobs or request.output.prompt_top_logprobs > 0


def input_bytes(request: pb.GenerateStreamRequest | pb.TokenizeRequest) -> int:
    """The size of what a request asks to tokenize, as UTF-8 (what the wire carried)."""
    if request.WhichOneof("input") == "chat":
        return chat_bytes(request.chat)
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
