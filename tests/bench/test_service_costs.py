"""bench.suite.service_ceiling's in-process measure kept honest: both sides stream every token of every call, one
message a token (callers that keep up), and report time on both the engine's side and the loop's."""

from __future__ import annotations

import asyncio

import pytest

from bench.suite.service_ceiling import minimal, tokenspout


@pytest.mark.parametrize("side", [tokenspout, minimal], ids=["tokenspout", "minimal"])
def test_each_side_streams_every_token_as_its_own_message(side) -> None:  # type: ignore[no-untyped-def]
    streams, tokens = 6, 12
    engine_s, loop_s, written = asyncio.run(side(streams, tokens))
    assert written.messages == streams * tokens
    assert written.finished == streams
    assert engine_s >= 0 and loop_s > 0
