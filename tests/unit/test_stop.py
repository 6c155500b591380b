"""StopChecker: EOS / stop tokens / stop strings / length, with plain fake decoders.

The byte decoder (id = one byte, decoded as UTF-8 with replacement) lets multi-byte characters
split across tokens; the property test compares the checker, which decodes only a tail, with a
brute-force decode of the whole output after every token."""
from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.request import FinishReason, SamplingParams
from common.sched.stop import StopChecker, find_stop_str

EOS = frozenset({300, 301})  # outside the byte range the byte decoder sees


def byte_decode(ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def run(checker: StopChecker, params: SamplingParams, ids: Sequence[int]) -> tuple[int, FinishReason | None]:
    """Append ids one by one; return how many were appended when the checker stopped, and why."""
    out: list[int] = []
    for t in ids:
        out.append(t)
        reason = checker.check(params, out)
        if reason is not None:
            return len(out), reason
    return len(out), None


def test_every_eos_id_stops_unless_ignore_eos() -> None:
    checker = StopChecker(EOS)
    for eos in EOS:
        assert checker.check(SamplingParams(), [5, eos]) == FinishReason(type="stop", matched=eos)
    assert checker.check(SamplingParams(ignore_eos=True), [5, 300]) is None
    assert checker.check(SamplingParams(), [300, 5]) is None  # only the newest token counts
    assert checker.check(SamplingParams(), []) is None


def test_stop_token_ids_apply_even_with_ignore_eos() -> None:
    checker = StopChecker(EOS)
    params = SamplingParams(stop_token_ids=[7, 9], ignore_eos=True)
    assert checker.check(params, [1, 9]) == FinishReason(type="stop", matched=9)
    assert checker.check(params, [1, 8]) is None


def test_length_and_its_order_against_stop_tokens() -> None:
    checker = StopChecker(EOS)
    params = SamplingParams(max_new_tokens=3)
    assert checker.check(params, [1, 2]) is None
    reason = checker.check(params, [1, 2, 3])
    assert reason == FinishReason(type="length", length=3)
    assert reason.to_json() == {"type": "length", "length": 3}
    # The last allowed token is EOS: the request ended on its own.
    assert checker.check(params, [1, 2, 301]) == FinishReason(type="stop", matched=301)
    assert checker.check(SamplingParams(max_new_tokens=3, ignore_eos=True), [1, 2, 301]).type == "length"


def test_stop_string_on_decoded_text_split_across_tokens() -> None:
    checker = StopChecker(EOS, byte_decode)
    params = SamplingParams(stop=["é!"])
    ids = list("ab".encode()) + list("é!".encode()) + list(b"zz")  # é is two bytes: two tokens
    n, reason = run(checker, params, ids)
    assert (n, reason) == (5, FinishReason(type="stop", matched="é!"))
    # The first byte of é alone, or followed by a byte that does not complete it, is no match.
    assert run(checker, SamplingParams(stop=["é"]), [0xC3, 0x41, 0x41])[1] is None
    assert run(checker, SamplingParams(stop=["é"]), [0x41, 0xC3, 0xA9]) == (3, FinishReason(type="stop", matched="é"))


def test_stop_string_ending_inside_a_long_token() -> None:
    vocab = {1: "hello", 2: " wor", 3: "ld and more", 4: "!"}

    def decode(ids: Sequence[int], skip: bool = True) -> str:
        return "".join(vocab[i] for i in ids)

    checker = StopChecker(EOS, decode)
    assert run(checker, SamplingParams(stop=["world"]), [1, 2, 3, 4]) == (3, FinishReason(type="stop", matched="world"))
    # The earliest occurrence wins when several stop strings complete on the same token.
    hit = run(checker, SamplingParams(stop=["more", "o wor"]), [1, 2, 3, 4])
    assert hit == (2, FinishReason(type="stop", matched="o wor"))


def test_stop_strings_see_skip_special_tokens() -> None:
    seen: list[bool] = []

    def decode(ids: Sequence[int], skip: bool = True) -> str:
        seen.append(skip)
        return "" if skip else "<eot>"

    checker = StopChecker(EOS, decode)
    assert checker.check(SamplingParams(stop=["<eot>"], skip_special_tokens=False), [3]) is not None
    assert checker.check(SamplingParams(stop=["<eot>"]), [3]) is None
    assert seen == [False, True]


def test_stop_strings_without_decoder_is_an_error() -> None:
    with pytest.raises(ValueError, match="decode"):
        StopChecker(EOS).check(SamplingParams(stop=["x"]), [1])


def test_find_stop_str() -> None:
    assert find_stop_str("abcabc", ["c", "b"]) == (1, "b")
    assert find_stop_str("abcabc", ["ab"], start=1) == (3, "ab")
    assert find_stop_str("abc", ["x"]) is None


_ALPHABET = ["a", "b", " ", "é", "中", "😀"]


@settings(max_examples=200, deadline=None)
@given(
    text=st.lists(st.sampled_from(_ALPHABET), min_size=1, max_size=30).map("".join),
    stops=st.lists(st.lists(st.sampled_from(_ALPHABET), min_size=1, max_size=3).map("".join), min_size=1, max_size=3),
    max_new=st.integers(min_value=1, max_value=200),
)
def test_tail_decoding_agrees_with_full_decode(text: str, stops: list[str], max_new: int) -> None:
    ids = list(text.encode())
    params = SamplingParams(stop=stops, max_new_tokens=max_new)
    n, reason = run(StopChecker(EOS, byte_decode), params, ids)
    # Reference: decode the whole output after every token.
    for k in range(1, len(ids) + 1):
        full = byte_decode(ids[:k])
        hit = find_stop_str(full, stops)
        if hit is not None:
            assert (n, reason) == (k, FinishReason(type="stop", matched=hit[1]))
            return
        if k >= max_new:
            assert (n, reason) == (k, FinishReason(type="length", length=max_new))
            return
    assert reason is None and n == len(ids)
