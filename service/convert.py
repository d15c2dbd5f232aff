"""The only place that turns engine events into protobuf messages."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from backend import (
    CallerTally,
    EngineStats,
    Finish,
    FinishReason,
    GeneratedToken,
    ModelInfo,
    PrefixReuse,
    SpeculationMode,
    SpeculationParams,
    TokenEvent,
)
from service.chat import ChatFormats
from service.limits import Limits
from tokenspout.v1 import generation_pb2 as pb

_FINISH_REASONS: dict[FinishReason, pb.FinishReason] = {
    FinishReason.EOS_TOKEN: pb.FINISH_REASON_EOS_TOKEN,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.STOP_TOKEN: pb.FINISH_REASON_STOP_TOKEN,
    FinishReason.MAX_TOKENS: pb.FINISH_REASON_MAX_TOKENS,
    FinishReason.TIME_LIMIT: pb.FINISH_REASON_TIME_LIMIT,
    FinishReason.CONTEXT_LIMIT: pb.FINISH_REASON_CONTEXT_LIMIT,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.CONSTRAINT_COMPLETE: pb.FINISH_REASON_CONSTRAINT_COMPLETE,
}


def _text_or_empty(piece: bytes) -> str:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return ""


def token_pb(token: GeneratedToken) -> pb.Token:
    message = pb.Token(id=token.token_id, text=_text_or_empty(token.piece), bytes=token.piece)
    if token.logprob is not None:
        message.logprob = token.logprob
    message.top_logprobs.extend(
        pb.TopLogprob(id=top.token_id, text=_text_or_empty(top.piece), logprob=top.logprob)
        for top in token.top_logprobs
    )
    return message


def finish_pb(finish: Finish) -> pb.Finish:
    usage, timings = finish.usage, finish.timings
    # The first token comes from prefill; the rest are decode steps.
    decode_tokens = max(usage.completion_tokens - 1, 0)
    message = pb.Finish(
        reason=_FINISH_REASONS[finish.reason],
        seed=finish.seed,
        usage=pb.Usage(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            draft_tokens=usage.draft_tokens,
            accepted_draft_tokens=usage.accepted_draft_tokens,
        ),
        timings=pb.Timings(
            queue_ms=timings.queue_s * 1000,
            time_to_first_token_ms=timings.time_to_first_token_s * 1000,
            prefill_ms=timings.prefill_s * 1000,
            decode_ms=timings.decode_s * 1000,
            total_ms=timings.total_s * 1000,
            tokens_per_second=decode_tokens / timings.decode_s if timings.decode_s > 0 else 0.0,
            constraint_compile_ms=timings.constraint_compile_s * 1000,
            constraint_mask_ms=timings.constraint_mask_s * 1000,
        ),
    )
    if finish.constraint_satisfied is not None:
        message.constraint_satisfied = finish.constraint_satisfied
        if not finish.constraint_satisfied:
            message.constraint_message = "the output ended before the constraint was complete"
    if finish.stop_sequence is not None:
        message.stop_sequence = finish.stop_sequence
    elif finish.stop_token_id is not None:
        message.stop_token_id = finish.stop_token_id
    return message


def stream_response(
    request_id: str, events: list[TokenEvent], with_tokens: bool, input_tokens: int = 0
) -> pb.GenerateStreamResponse:
    """One response message for a batch of events (in order) of one request."""
    last = events[-1]
    alone = len(events) == 1  # a caller that keeps up: one event a message, the common case at scale
    message = pb.GenerateStreamResponse()  # fields set one by one: in upb, cheaper than keyword arguments
    message.request_id = request_id
    message.text = last.text if alone else "".join(event.text for event in events)
    message.generated_tokens = last.generated_tokens
    if input_tokens:
        message.input_tokens = input_tokens
    if with_tokens:
        message.tokens.extend(token_pb(token) for event in events for token in event.tokens)
    if not alone or last.prompt_tokens:
        message.prompt_tokens.extend(token_pb(token) for event in events for token in event.prompt_tokens)
    if last.finish is not None:
        message.finish.CopyFrom(finish_pb(last.finish))
    return message


SPECULATION_MODES = {
    SpeculationMode.OFF: pb.SPECULATION_MODE_OFF,
    SpeculationMode.NGRAM: pb.SPECULATION_MODE_NGRAM,
    SpeculationMode.DRAFT_MODEL: pb.SPECULATION_MODE_DRAFT_MODEL,
}


PREFIX_REUSE = {
    PrefixReuse.OFF: pb.PREFIX_REUSE_OFF,
    PrefixReuse.AS_CACHED: pb.PREFIX_REUSE_AS_CACHED,
    PrefixReuse.EXACT: pb.PREFIX_REUSE_EXACT,
}


def speculation_pb(params: SpeculationParams) -> pb.Speculation:
    return pb.Speculation(mode=SPECULATION_MODES[params.mode], max_draft_tokens=params.max_draft_tokens)


def model_info(info: ModelInfo, limits: Limits, formats: ChatFormats) -> pb.GetModelInfoResponse:
    return pb.GetModelInfoResponse(
        tool_call_format=formats.tools.name if formats.tools else "",
        template_renders_tools=formats.template_renders_tools,
        reasoning_format=formats.reasoning.name if formats.reasoning else "",
        model_id=info.model_id,
        engine=info.engine,
        context_length=info.context_length,
        vocab_size=info.vocab_size,
        special_tokens=pb.SpecialTokens(bos_token_id=info.bos_token_id, eos_token_ids=info.eos_token_ids),
        samplers=info.samplers,
        constraint_kinds=info.constraint_kinds,
        has_chat_template=info.has_chat_template,
        quantization=info.quantization,
        speculation_modes=[SPECULATION_MODES[mode] for mode in info.speculation_modes],
        default_speculation=speculation_pb(info.default_speculation),
        request_features=info.request_features,
        attention_provider=info.attention_provider,
        cache_block_size=info.cache_block_size,
        reuses_decoded_cells=info.reuses_decoded_cells,
        prefix_reuse=PREFIX_REUSE[info.prefix_reuse],
        limits=pb.Limits(
            max_batch_size=info.max_batch_size,
            max_new_tokens=info.context_length,
            max_stop_sequences=limits.max_stop_sequences,
            max_stop_sequence_length=limits.max_stop_sequence_length,
            max_top_logprobs=limits.max_top_logprobs,
            max_logit_bias_entries=limits.max_logit_bias_entries,
            max_samples=limits.max_samples,
            max_tokenize_texts=limits.max_tokenize_texts,
        ),
    )


def unary_response(messages: list[pb.GenerateStreamResponse]) -> pb.GenerateResponse:
    """The whole result: sample 0's in the top-level fields, and with several samples each one in `samples`."""
    by_sample: dict[int, list[pb.GenerateStreamResponse]] = {}
    for message in messages:
        by_sample.setdefault(message.index, []).append(message)
    first = by_sample[0]
    response = pb.GenerateResponse(
        request_id=first[0].request_id,
        input_tokens=first[0].input_tokens,
        truncated_input_tokens=first[0].truncated_input_tokens,
    )
    response.prompt_tokens.extend(first[0].prompt_tokens)
    for index in sorted(by_sample):
        sample = by_sample[index]
        last = sample[-1]
        result = pb.Sample(index=index, text="".join(m.text for m in sample), generated_tokens=last.generated_tokens,
                           finish=last.finish, reasoning="".join(m.reasoning for m in sample))
        result.tokens.extend(token for m in sample for token in m.tokens)
        result.tool_calls.extend(call for m in sample for call in m.tool_calls)
        if index == 0:
            response.text, response.generated_tokens = result.text, result.generated_tokens
            response.reasoning = result.reasoning
            response.tool_calls.extend(result.tool_calls)
            response.tokens.extend(result.tokens)
            response.finish.CopyFrom(result.finish)
        if len(by_sample) > 1:
            response.samples.append(result)
    return response


def server_status(
    stats: EngineStats, info: ModelInfo, *, max_queued_requests: int, rejected_total: int, draining: bool,
    callers: list[pb.CallerStatus], cache_events_sequence: int = 0,
) -> pb.GetServerStatusResponse:
    """The engine's figures, with what the service adds: the door's refusals, draining, and each caller's status."""
    return pb.GetServerStatusResponse(
        running_sequences=stats.running_sequences,
        queued_requests=stats.queued_requests,
        paused_sequences=stats.paused_sequences,
        cache_tokens_used=stats.cache_tokens_used,
        cache_tokens_free=stats.cache_tokens_total - stats.cache_tokens_used,
        max_batch_size=info.max_batch_size,
        max_queued_requests=max_queued_requests,
        engine_steps=stats.steps,
        cancelled_total=stats.cancelled_total,
        last_cancel_latency_steps=stats.last_cancel_latency_steps,
        last_cancel_latency_ms=stats.last_cancel_latency_s * 1000,
        max_cancel_latency_steps=stats.max_cancel_latency_steps,
        rejected_total=rejected_total,
        draining=draining,
        started_total=stats.started_total,
        cached_prefixes=stats.prefix_cache_entries,
        cached_prefix_tokens=stats.prefix_cache_tokens,
        prompt_tokens_total=stats.prompt_tokens_total,
        cached_prompt_tokens_total=stats.cached_prompt_tokens_total,
        prefix_cache_hit_rate=stats.prefix_hit_rate,
        preempted_total=stats.preempted_total,
        preempted_sequences=stats.preempted_sequences,
        recomputed_tokens_total=stats.recomputed_tokens_total,
        retiled_tokens_total=stats.retiled_tokens_total,
        engine_restarts=stats.engine_restarts,
        draft_tokens_total=stats.draft_tokens_total,
        accepted_draft_tokens_total=stats.accepted_draft_tokens_total,
        cache_block_size=info.cache_block_size,
        cache_events_sequence=cache_events_sequence,
        attention_provider=info.attention_provider,
        prefix_reuse=PREFIX_REUSE[info.prefix_reuse],
        callers=callers,
    )


def caller_statuses(
    tallies: tuple[CallerTally, ...], refused: Mapping[str, int], weight_of: Callable[[str], float]
) -> list[pb.CallerStatus]:
    """The engine's per-caller figures with the refusals at the door, callers only refused last."""
    statuses = [
        pb.CallerStatus(
            caller=t.caller,
            running_sequences=t.running,
            queued_requests=t.queued,
            preempted_sequences=t.preempted,
            prompt_tokens_total=t.prompt_tokens_total,
            generated_tokens_total=t.generated_tokens_total,
            preempted_total=t.preempted_total,
            refused_total=refused.get(t.caller, 0),
            shed_total=t.shed_total,
            queue_timeouts_total=t.queue_timeouts_total,
            weight=t.weight,
        )
        for t in tallies
    ]
    known = {t.caller for t in tallies}
    statuses.extend(
        pb.CallerStatus(caller=key, refused_total=count, weight=weight_of(key))
        for key, count in refused.items() if key not in known
    )
    return statuses
