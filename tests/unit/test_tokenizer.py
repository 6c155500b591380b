"""Tokenizer wrapper and IncrementalDetokenizer on the tiny model's byte-level BPE tokenizer.

Detokenizer properties (hypothesis): for random id sequences fed in random chunks, what has been
returned is at every step a prefix of ``decode(ids fed so far)`` (so nothing is ever retracted and
no U+FFFD of an unfinished character escapes), and after finish the pieces concatenate to
``decode(all ids)``, cut before the first stop string when there is one."""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.request import FinishReason, InvalidRequest, SamplingParams
from common.sched.stop import StopChecker, find_stop_str
from common.tokenizer import IncrementalDetokenizer, Tokenizer
from common.tokenizer.detokenizer import stop_prefix_len
from common.tools.make_tiny_model import make_tiny_model

SAMPLE = "Hello wörld! 中文：你好，世界 😀🚀 naïve café — “quotes” ½ end."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "qwen3"), arch="qwen3", seed=0)


@pytest.fixture(scope="module")
def tok(model_dir: str) -> Tokenizer:
    return Tokenizer(model_dir)


def _json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ----------------------------------------------------------------------------- wrapper


def test_encode_decode_agree_with_transformers(tok: Tokenizer, model_dir: str) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.encode(SAMPLE)
    assert ids == hf.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE == hf.decode(ids)
    with_special = tok.encode("a<|im_end|>b")
    assert tok.decode(with_special, skip_special_tokens=False) == "a<|im_end|>b"
    assert tok.decode(with_special) == "ab"
    assert len(ids) < len(SAMPLE.encode())  # merges happened: not just a byte tokenizer


def test_eos_ids_and_vocab_size(tok: Tokenizer, model_dir: str) -> None:
    gen = _json(os.path.join(model_dir, "generation_config.json"))
    cfg = _json(os.path.join(model_dir, "config.json"))
    assert isinstance(gen["eos_token_id"], list) and len(gen["eos_token_id"]) == 2
    assert tok.eos_token_ids == frozenset(gen["eos_token_id"]) | {tok.encode("<|im_end|>")[0]}
    assert tok.vocab_size == cfg["vocab_size"]
    assert tok.id_to_token(tok.vocab_size - 1) is not None


def test_eos_ids_fall_back_to_config_json(model_dir: str, tmp_path: pytest.TempPathFactory) -> None:
    d = str(tmp_path / "m")
    shutil.copytree(model_dir, d)
    os.remove(os.path.join(d, "generation_config.json"))
    cfg = _json(os.path.join(d, "config.json"))
    endoftext = Tokenizer(model_dir).encode("<|endoftext|>")[0]
    cfg["eos_token_id"] = endoftext
    with open(os.path.join(d, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    im_end = Tokenizer(d).encode("<|im_end|>")[0]  # the tokenizer's own eos is always included
    assert Tokenizer(d).eos_token_ids == frozenset({endoftext, im_end})


def test_chat_template(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n<|im_start|>assistant\n"
    assert text == expected
    ids = tok.apply_chat_template(messages)
    assert ids == tok.encode(expected, add_special_tokens=False)
    assert ids[0] == tok.encode("<|im_start|>")[0] and tok.decode(ids, skip_special_tokens=False) == expected
    no_gen = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_gen == expected.removesuffix("<|im_start|>assistant\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts, tokenize=False).startswith("<|im_start|>user\na\nb<|im_end|>")


def test_chat_template_errors_are_invalid_requests(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequest, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(InvalidRequest, match="chat template failed: no tools here"):
        bad = "{{ raise_exception('no tools here') }}"
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=bad)
    with pytest.raises(InvalidRequest, match="objects"):
        tok.apply_chat_template(["hello"])  # type: ignore[list-item]


def test_no_chat_template(model_dir: str, tmp_path: pytest.TempPathFactory) -> None:
    d = str(tmp_path / "m")
    shutil.copytree(model_dir, d)
    cfg_path = os.path.join(d, "tokenizer_config.json")
    cfg = _json(cfg_path)
    del cfg["chat_template"]
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    with pytest.raises(InvalidRequest, match="no chat template"):
        Tokenizer(d).apply_chat_template([{"role": "user", "content": "x"}])


# ----------------------------------------------------------------------------- detokenizer helpers


def feed(det: IncrementalDetokenizer, chunks: Sequence[Sequence[int]], finish: FinishReason) -> list[str]:
    pieces = [det.add(c) for c in chunks[:-1]]
    pieces.append(det.add(chunks[-1], finish))
    return pieces


def _byte_tokens(tok: Tokenizer) -> list[int]:
    """id of the single-byte token of each byte value 0..255.

    Byte-level BPE spells byte b as one printable character (GPT-2's byte-to-unicode table:
    printable Latin-1 bytes stand for themselves, the others map to U+0100 onwards in order).
    """
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    ids, extra = [], 0
    for b in range(256):
        if b in printable:
            ch = chr(b)
        else:
            ch, extra = chr(0x100 + extra), extra + 1
        tid = tok.token_to_id(ch)
        assert tid is not None, (b, ch)
        ids.append(tid)
    return ids


def test_multibyte_characters_split_into_byte_tokens_are_never_broken(tok: Tokenizer) -> None:
    byte_tok = _byte_tokens(tok)
    text = "a😀b中é"
    ids = [byte_tok[b] for b in text.encode()]
    assert tok.decode(ids) == text
    det = IncrementalDetokenizer(tok)
    pieces = [det.add([i]) for i in ids[:-1]] + [det.add(ids[-1:], FinishReason(type="length", length=len(ids)))]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text == det.text
    assert "😀" in pieces and "中" in pieces  # released whole, on the byte that completed it
    assert pieces[1:4] == ["", "", ""]  # the first three bytes of the emoji were held


def test_genuinely_invalid_bytes_are_released(tok: Tokenizer) -> None:
    byte_tok = _byte_tokens(tok)
    ids = [byte_tok[0xE4], byte_tok[ord("x")], byte_tok[0xFF]]  # truncated 3-byte char, x, invalid byte
    det = IncrementalDetokenizer(tok)
    assert det.add(ids[:1]) == ""  # might still be completed
    assert det.add(ids[1:2]) == "\ufffdx"  # now it cannot
    assert det.add(ids[2:]) == ""
    assert det.add([], FinishReason(type="length", length=3)) == "\ufffd"
    assert det.text == tok.decode(ids) and det.finished


def test_stop_token_is_not_in_text(tok: Tokenizer) -> None:
    ids = tok.encode("Hi there!")
    bang = ids[-1]
    det = IncrementalDetokenizer(tok)
    pieces = [det.add([i]) for i in ids[:-1]] + [det.add([bang], FinishReason(type="stop", matched=bang))]
    assert "".join(pieces) == "Hi there"
    assert det.add(tok.encode("more")) == ""  # finished: later ids are ignored
    eos = tok.encode("<|im_end|>")[0]
    det = IncrementalDetokenizer(tok, skip_special_tokens=False)
    out = det.add(tok.encode("ok"))
    out += det.add([eos], FinishReason(type="stop", matched=eos))
    assert out == "ok"


def test_stop_string_prefix_is_held_then_released(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, stop=["STOP"])
    assert det.add(tok.encode("abc ST")) == "abc "
    assert det.add(tok.encode("x")) == "STx"  # not a stop string after all
    assert det.add(tok.encode(" S")) == " "
    assert det.add([], FinishReason(type="length", length=9)) == "S"  # finish releases the hold
    det = IncrementalDetokenizer(tok, stop=["STOP", "!"])
    assert det.add(tok.encode("ab ST")) == "ab "
    assert det.add(tok.encode("OP and more! x")) == ""  # cut at the stop string, rest dropped
    assert det.finished and det.text == "ab "
    assert det.add([], FinishReason(type="stop", matched="STOP")) == ""


def test_stop_prefix_len() -> None:
    assert stop_prefix_len("abcST", ["STOP"]) == 2
    assert stop_prefix_len("abcSTOP", ["STOP"]) == 0  # a whole match is the caller's business
    assert stop_prefix_len("xaa", ["aab", "ab"]) == 2
    assert stop_prefix_len("", ["ab"]) == 0


def test_context_ids_are_not_returned(tok: Tokenizer) -> None:
    prompt = tok.encode("The answer is")
    out = tok.encode(" forty-two 中")
    det = IncrementalDetokenizer(tok, context_ids=prompt[-5:])
    text = "".join(det.add([i]) for i in out) + det.add([], FinishReason(type="length", length=len(out)))
    assert text == tok.decode(prompt[-5:] + out)[len(tok.decode(prompt[-5:])) :] == " forty-two 中"


def test_a_character_cut_at_the_prompt_answer_boundary_counts_as_the_prompt_s(tok: Tokenizer) -> None:
    """The prompt ends on a character's first byte and the answer starts with a second one (random
    ids do this): together they are one unfinished character, one U+FFFD, and it is the prompt's.
    The answer's text is what it adds to ``decode(prompt + answer)``, not ``decode(answer)``, which
    would show a U+FFFD the prompt's text already has (tests/chaos's oracle judges by this)."""
    byte_tok = _byte_tokens(tok)
    prompt = tok.encode("x") + [byte_tok[0xE4]]
    answer = [byte_tok[0xB8]] + tok.encode(" ok")
    det = IncrementalDetokenizer(tok, context_ids=prompt[-5:])
    text = "".join(det.add([i]) for i in answer) + det.add([], FinishReason(type="length", length=len(answer)))
    assert tok.decode(answer) == "\ufffd ok" and tok.decode(prompt) == "x\ufffd"
    assert text == " ok" == tok.decode(prompt + answer)[len(tok.decode(prompt)):]


class _MetaspaceWords:
    """A SentencePiece-style decoder: a word's leading space is dropped at the start of a decode."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer as RawTokenizer
        from tokenizers import decoders, models

        vocab = {"[UNK]": 0, "\u2581Hello": 1, "\u2581world": 2, "!": 3, "\u2581中": 4, "文": 5}
        self._t = RawTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        self._t.decoder = decoders.Metaspace()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._t.decode(list(ids), skip_special_tokens=skip_special_tokens)


def test_leading_space_of_sentencepiece_words_survives() -> None:
    sp = _MetaspaceWords()
    assert sp.decode([2]) == "world" and sp.decode([1, 2, 3, 4, 5]) == "Hello world! 中文"
    det = IncrementalDetokenizer(sp)
    pieces = [det.add([i]) for i in [1, 2, 3, 4]] + [det.add([5], FinishReason(type="length", length=5))]
    assert pieces == ["Hello", " world", "!", " 中", "文"]
    det = IncrementalDetokenizer(sp, context_ids=[1])
    assert det.add([2]) + det.add([3], FinishReason(type="length", length=2)) == " world!"


# ----------------------------------------------------------------------------- properties


@st.composite
def chunked(draw: st.DrawFn, ids: list[int]) -> list[list[int]]:
    """Split ``ids`` into consecutive chunks of 1..4 (the last one may be empty)."""
    chunks, i = [], 0
    while i < len(ids):
        n = draw(st.integers(min_value=1, max_value=4))
        chunks.append(ids[i : i + n])
        i += n
    return chunks or [[]]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_ids_increments_equal_full_decode(tok: Tokenizer, data: st.DataObject) -> None:
    byte_tok = _byte_tokens(tok)
    # Mix arbitrary vocabulary ids (merges, specials) with raw bytes of multi-byte characters so
    # that characters are split across ids in every way.
    any_id = st.integers(min_value=0, max_value=tok.vocab_size - 1)
    multibyte = st.sampled_from(list("é中😀½—")).map(lambda c: [byte_tok[b] for b in c.encode()])
    pieces = data.draw(st.lists(st.one_of(any_id.map(lambda i: [i]), multibyte), min_size=1, max_size=25))
    ids = [i for p in pieces for i in p]
    skip = data.draw(st.booleans())
    chunks = data.draw(chunked(ids))
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    fed: list[int] = []
    out = ""
    for n, chunk in enumerate(chunks):
        fed.extend(chunk)
        last = n == len(chunks) - 1
        out += det.add(chunk, FinishReason(type="length", length=len(ids)) if last else None)
        if not last:
            assert tok.decode(fed, skip).startswith(out)
    assert out == tok.decode(ids, skip)


_TEXT_ALPHABET = list("ab c.!") + ["é", "中", "😀", "ST", "OP", "\n"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.lists(st.sampled_from(_TEXT_ALPHABET), min_size=1, max_size=25).map("".join),
    stops=st.lists(st.lists(st.sampled_from(_TEXT_ALPHABET), min_size=1, max_size=3).map("".join), max_size=3),
    max_new=st.integers(min_value=1, max_value=40),
)
def test_scheduler_and_detokenizer_agree_on_stop_strings(
    tok: Tokenizer, text: str, stops: list[str], max_new: int
) -> None:
    """The scheduler's StopChecker decides when to stop; the detokenizer, fed each step's token
    and the finish reason, returns the output text cut before the first stop string."""
    ids = tok.encode(text)
    params = SamplingParams(stop=stops, max_new_tokens=max_new)
    checker = StopChecker(tok.eos_token_ids, tok.decode)
    det = IncrementalDetokenizer(tok, stop=stops)
    output: list[int] = []
    out = ""
    reason = None
    for t in ids:
        output.append(t)
        reason = checker.check(params, output)
        out += det.add([t], reason)
        if reason is None:
            assert tok.decode(output).startswith(out)
        else:
            break
    if reason is None:
        out += det.add([], FinishReason(type="abort", message="ran out of ids"))
    full = tok.decode(output)
    hit = find_stop_str(full, stops)
    expected = full[: hit[0]] if hit is not None else full
    assert out == expected
    if hit is not None:
        assert reason == FinishReason(type="stop", matched=hit[1])
    assert not any(s in out for s in stops)
