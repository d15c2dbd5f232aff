"""A call's samples as their messages go out: each sample's events turned into stream messages, in order."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Protocol

from backend import Finish, FinishReason, GenerationRequest, TokenEvent
from backend.constraints import ConstraintSpec, json_output_problem
from service import convert
from service.errors import deadline_exceeded
from tokenspout.v1 import generation_pb2 as pb


class SampleParser(Protocol):
    """One sample's reader of its own output (a chat's: service.chat.output), given each of its messages in order
    to rewrite before it goes out."""

    def rewrite(self, message: pb.GenerateStreamResponse, events: Sequence[TokenEvent]) -> None: ...


class Samples:
    """A call's samples as their messages go out: which have sent their first (it carries the input's counts),
    how each finished, and with a non-strict JSON constraint, the text to check once it ends."""

    def __init__(
        self, generation: GenerationRequest, request_id: str, output_parser: Callable[[], SampleParser] | None = None,
    ) -> None:
        self._generation = generation
        self._output_parser = output_parser
        """Makes each sample's parser, when the output is parsed (a chat's reasoning and tool calls)."""
        self._parsers: dict[int, SampleParser] = {}
        self._request_id = request_id
        self.n = generation.n
        self._with_tokens = generation.output.return_tokens
        self._started: set[int] = set()
        self._generated: dict[int, int] = {}
        self.finishes: dict[int, Finish] = {}
        self.done = False
        """Every sample has finished (an attribute, not a property: read after every message)."""
        constraint = generation.constraint
        self._approximated: ConstraintSpec | None = None if constraint is None or constraint.strict else constraint
        self._texts: dict[int, list[str]] = collections.defaultdict(list)

    def message(self, index: int, events: list[TokenEvent]) -> pb.GenerateStreamResponse:
        """One sample's events as a message. Raises DEADLINE_EXCEEDED when the caller's deadline ended the sample."""
        if index in self._started:  # every message but a sample's first: nothing more to set than the events
            message = convert.stream_response(self._request_id, events, self._with_tokens)
        else:
            self._started.add(index)
            generation = self._generation
            message = convert.stream_response(self._request_id, events, self._with_tokens,
                                              len(generation.prompt_token_ids))
            message.truncated_input_tokens = generation.truncated_tokens
        if index:  # 0 is the field's default: nothing to set
            message.index = index
        if self._output_parser is not None:
            parser = self._parsers.get(index)
            if parser is None:  # a sample's first message (setdefault would make a parser for every one)
                parser = self._parsers[index] = self._output_parser()
            parser.rewrite(message, events)
        self._generated[index] = events[-1].generated_tokens
        finish = events[-1].finish
        if finish is not None:
            self.finishes[index] = finish
            self.done = len(self.finishes) == self.n
            if finish.reason is FinishReason.TIME_LIMIT and self._generation.ends_at_deadline:
                # gRPC's contract: a call past the caller's deadline fails. Ending it OK would
                # race the caller's own timer, so a loaded client could see either outcome.
                raise deadline_exceeded(self._request_id, events[-1].generated_tokens)
        if self._approximated is not None:
            self._check_output(index, message, self._approximated)
        return message

    @property
    def generated_tokens(self) -> int:
        """Tokens the samples' messages have carried so far, all samples together."""
        return sum(self._generated.values())

    def _check_output(self, index: int, message: pb.GenerateStreamResponse, spec: ConstraintSpec) -> None:
        """Non-strict JSON constraints were approximated: say honestly, at the end, whether the output complies."""
        self._texts[index].append(message.text)
        if not message.HasField("finish"):
            return
        problem = json_output_problem(spec, "".join(self._texts[index]))
        if problem:
            message.finish.constraint_satisfied = False
            message.finish.constraint_message = problem


def by_sample(batch: list[TokenEvent]) -> list[tuple[int, list[TokenEvent]]]:
    """A batch's events grouped by sample, each sample's in order, the samples in order of first event."""
    grouped: dict[int, list[TokenEvent]] = {}
    for event in batch:
        grouped.setdefault(event.index, []).append(event)
    return list(grouped.items())
