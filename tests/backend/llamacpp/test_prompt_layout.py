"""The prompt layout alone (no model): every row lands in a group of the mode the layout says, and
reuse never takes a row computed in another mode."""

from __future__ import annotations

import itertools

import pytest

from backend.llamacpp.layout import MIN_GROUP, TILE_ROWS, PromptLayout

BATCH = 512


def groups(layout: PromptLayout, cached: int = 0, batch_tokens: int = BATCH) -> list[tuple[int, int]]:
    """The (start, rows) of every llama_decode the prompt's prefill takes from `cached`."""
    out = []
    while cached < layout.length:
        rows = layout.next_group(cached, batch_tokens)
        assert rows > 0
        out.append((cached, rows))
        cached += rows
    return out


def check_modes(layout: PromptLayout, cached: int = 0, batch_tokens: int = BATCH) -> None:
    for start, rows in groups(layout, cached, batch_tokens):
        tiled = start < layout.tiled_until
        assert (start + rows <= layout.tiled_until) if tiled else (start >= layout.tiled_until)
        assert rows >= TILE_ROWS if tiled else MIN_GROUP <= rows < TILE_ROWS or layout.length == 1


@pytest.mark.parametrize(
    "length", [1, 2, 3, 40, 63, 64, 65, 66, 67, 127, 128, 129, 130, 511, 512, 513, 575, 576, 577, 578, 1426, 2047]
)
@pytest.mark.parametrize("last_message_start", [0, 1, 30, 64, 100, 500, 1400])
def test_every_row_is_in_a_group_of_its_mode(length, last_message_start):
    layout = PromptLayout.of(length, last_message_start, BATCH)
    assert 0 <= layout.tiled_until <= max(0, length - MIN_GROUP)
    check_modes(layout)


def test_a_chat_is_tiled_up_to_its_last_message():
    assert PromptLayout.of(1426, 1400, BATCH).tiled_until == 1400
    # a last message of 64 tokens or more: whole tiles of it too, leaving 2 to 65 rows
    assert PromptLayout.of(1500, 1400, BATCH).tiled_until == 1464
    # a history shorter than a tile: tiles from the start
    assert PromptLayout.of(200, 40, BATCH).tiled_until == 192


def test_a_small_batch_computes_every_row_in_small_groups():
    layout = PromptLayout.of(300, 0, 100)
    assert layout.tiled_until == 0
    check_modes(layout, batch_tokens=100)


@pytest.mark.parametrize("a_length,a_start,b_length,b_start", [
    (1426, 1400, 1431, 1400), (1426, 1400, 1500, 1480), (600, 0, 610, 0), (600, 0, 650, 0), (130, 0, 300, 200),
    (60, 0, 62, 0), (60, 0, 200, 0), (1000, 900, 1000, 0),
])
def test_reuse_takes_only_rows_computed_in_the_mode_the_new_layout_asks(a_length, a_start, b_length, b_start):
    cached = PromptLayout.of(a_length, a_start, BATCH)
    new = PromptLayout.of(b_length, b_start, BATCH)
    for common in range(0, min(a_length, b_length) + 1, 7):
        rows = new.reusable(common, cached.tiled_until)
        assert 0 <= rows <= min(common, b_length - MIN_GROUP)
        for row in range(rows):  # each reused row was computed as the new layout would
            assert (row < cached.tiled_until) == (row < new.tiled_until)
        check_modes(new, cached=rows)


def test_the_same_history_with_a_new_question_computes_only_the_question():
    first = PromptLayout.of(1426, 1400, BATCH)
    second = PromptLayout.of(1431, 1400, BATCH)
    assert second.reusable(1400, first.tiled_until) == 1400


def test_every_cached_split_recomputes_the_same_groups_in_mode():
    for length, start in itertools.product([130, 700], [0, 100]):
        layout = PromptLayout.of(length, start, BATCH)
        for common in range(length):
            check_modes(layout, cached=layout.reusable(common, layout.tiled_until))


def test_a_short_history_and_message_go_in_small_groups_so_the_history_is_reusable():
    first, second = PromptLayout.of(90, 50, BATCH), PromptLayout.of(80, 50, BATCH)
    assert first.tiled_until == second.tiled_until == 0
    assert second.reusable(50, first.tiled_until) == 50
