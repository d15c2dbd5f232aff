"""Unit tests of streamed-text safety: complete UTF-8 only, no leaked stop sequences."""

from backend.common.text import StopSequenceFilter, Utf8Stream


def test_utf8_stream_waits_for_the_last_byte_of_a_code_point():
    emoji = "🙂".encode()
    stream = Utf8Stream()
    assert [stream.feed(emoji[:1]), stream.feed(emoji[1:3]), stream.feed(emoji[3:])] == ["", "", "🙂"]
    assert stream.flush() == ""


def test_utf8_stream_replaces_only_bytes_that_can_never_be_valid():
    stream = Utf8Stream()
    assert stream.feed(b"a\xffb") == "a\ufffdb"
    assert stream.feed("東".encode()[:2]) == ""
    assert stream.flush() == ""  # a code point cut off at the very end is dropped


def push_all(stop: StopSequenceFilter, pieces: list[str]) -> str:
    return "".join(stop.push(p) for p in pieces)


def test_stop_sequence_split_across_pieces_never_leaks():
    stop = StopSequenceFilter(("</end>",))
    emitted = [stop.push(p) for p in ["Hello <", "/en", "d> trailing"]]
    assert emitted == ["Hello ", "", ""]
    assert stop.matched is not None and stop.matched.stop_sequence == "</end>"


def test_held_text_is_released_when_it_turns_out_not_to_be_a_stop():
    stop = StopSequenceFilter(("STOP",))
    assert stop.push("ab ST") == "ab "
    assert stop.push("AR") == "STAR"
    assert stop.push("S") == ""
    assert stop.flush() == "S"
    assert stop.matched is None


def test_earliest_stop_wins_and_can_be_included():
    stop = StopSequenceFilter(("world", "lo"), include_stop_sequence=True)
    assert push_all(stop, ["hello world"]) == "hello"
    assert stop.matched.stop_sequence == "lo"


def test_no_stops_passes_everything_through():
    stop = StopSequenceFilter(())
    assert push_all(stop, ["a", "b"]) == "ab"
    assert stop.flush() == ""
