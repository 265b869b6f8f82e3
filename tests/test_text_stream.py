"""TextStream: incremental detokenizing that is UTF-8 safe and cuts at stop strings.

Most cases run on SmolLM2's real byte-level BPE tokenizer (split emoji/CJK, real token
boundaries); the tiny word-level tokenizer covers special tokens between words.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.model.loader import LoadedModel
from engine.model.tokenizer import ChatMessage, HFTokenizer, Tokenizer
from engine.output.text_stream import TextDelta, TextStream
from tests.tiny_llama import save_tiny_tokenizer

FFFD = "\ufffd"
UNICODE_TEXT = "héllo wörld 🙂🎉 日本語"
PROPERTY_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def real(smollm: LoadedModel) -> Tokenizer:
    return smollm.tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    folder: Path = tmp_path_factory.mktemp("tiny_tokenizer")
    save_tiny_tokenizer(folder)
    return HFTokenizer(folder)


def enc(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def one_token(tok: Tokenizer, text: str) -> int:
    """The id of `text` if the tokenizer really has it as one token."""
    (token,) = enc(tok, text)
    assert tok.decode([token]) == text
    return token


def split_byte_ids(tok: Tokenizer) -> list[int]:
    """Tokens that are a fragment of a multi-byte character (they decode alone to U+FFFD)."""
    ids = [t for t in enc(tok, "🎉日本語") if tok.decode([t]) == FFFD]
    assert len(ids) >= 4
    return ids


def run(
    tok: Tokenizer,
    ids: Sequence[int],
    stops: Sequence[str] = (),
    skip: bool = True,
    chunks: Sequence[int] = (1,),
) -> tuple[list[TextDelta], str]:
    """Push `ids` in chunks of the given sizes (cycled) until a stop; return the deltas and finish()."""
    stream = TextStream(tok, stops, skip)
    deltas: list[TextDelta] = []
    pos = 0
    while pos < len(ids):
        size = chunks[len(deltas) % len(chunks)]
        deltas.append(stream.push(ids[pos : pos + size]))
        pos += size
        if deltas[-1].stop_string is not None:
            break
    return deltas, stream.finish()


def joined(deltas: Sequence[TextDelta]) -> str:
    return "".join(d.text for d in deltas)


def stable(text: str) -> str:
    return text.rstrip(FFFD) if text.endswith(FFFD) else text


# --- UTF-8 safety and equality with a full decode -------------------------------------------------


@pytest.mark.slow
def test_emoji_and_cjk_split_across_tokens(real: Tokenizer) -> None:
    ids = enc(real, UNICODE_TEXT)
    assert any(real.decode([t]).endswith(FFFD) for t in ids)  # the text really splits characters
    deltas, tail = run(real, ids)
    assert joined(deltas) + tail == real.decode(ids) == UNICODE_TEXT
    assert all(FFFD not in d.text for d in deltas)
    assert tail == ""
    # Partial text before a split character is released at once (" " from the token " \xe6\x97").
    assert [d.text for d in deltas].count(" ") >= 1


@pytest.mark.slow
def test_genuine_replacement_character_at_finish_is_emitted(real: Tokenizer) -> None:
    lead = enc(real, "🎉")[0]  # the first bytes of a 4-byte character, never completed
    ids = [*enc(real, "ok "), lead]
    deltas, tail = run(real, ids)
    assert joined(deltas) == "ok "
    assert tail == FFFD
    assert joined(deltas) + tail == real.decode(ids)


@pytest.mark.slow
@pytest.mark.parametrize("garbage", [0, 1, 5, 13, 14, 15, 16, 17, 18, 31, 40])
def test_long_invalid_byte_runs_then_a_character(real: Tokenizer, garbage: int) -> None:
    # Lone continuation bytes keep the text ending in U+FFFD, forcing the bounded window to move
    # on; the character after them must still come out whole wherever that move lands.
    continuation = split_byte_ids(real)[1]
    ids = [*enc(real, "a"), *[continuation] * garbage, *enc(real, "🎉b日")]
    deltas, tail = run(real, ids)
    assert joined(deltas) + tail == real.decode(ids)
    assert "🎉b日" in joined(deltas)


@pytest.mark.slow
@PROPERTY_SETTINGS
@given(data=st.data(), skip=st.booleans())
def test_random_token_sequences_match_full_decode(real: Tokenizer, data: st.DataObject, skip: bool) -> None:
    split = split_byte_ids(real)
    special = sorted({0, 1, 2} | real.eos_token_ids)
    token = st.one_of(st.integers(0, real.vocab_size - 1), st.sampled_from(split), st.sampled_from(special))
    ids = data.draw(st.lists(token, max_size=60), label="ids")
    chunks = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=5), label="chunks")
    deltas, tail = run(real, ids, skip=skip, chunks=chunks)
    full = real.decode(ids, skip_special_tokens=skip)
    assert joined(deltas) + tail == full
    assert sum(d.tokens_consumed for d in deltas) == len(ids)
    if FFFD not in full:
        assert all(FFFD not in d.text for d in deltas)


class Counting:
    """Delegates to the real tokenizer, recording how many ids each decode sees."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.inner.eos_token_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.inner.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        self.sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens)

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        return self.inner.render_chat(messages, add_generation_prompt)

    def encode_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        return self.inner.encode_chat(messages, add_generation_prompt)

    def backend_json(self) -> str:
        return self.inner.backend_json()


@pytest.mark.slow
def test_decode_window_stays_small(real: Tokenizer) -> None:
    continuation = split_byte_ids(real)[1]
    block = [*enc(real, UNICODE_TEXT + " "), *[continuation] * 50, *[2] * 50]
    ids = block * 40  # ~4,600 tokens
    counting = Counting(real)
    deltas, tail = run(counting, ids, stops=["never appears in this text at all"], skip=True)
    assert joined(deltas) + tail == real.decode(ids, skip_special_tokens=True)
    assert max(counting.sizes) <= 40  # a bounded window, not the whole output
    assert len(counting.sizes) <= 3 * len(ids)


@pytest.mark.slow
def test_plain_text_costs_about_one_decode_per_token(real: Tokenizer) -> None:
    # Context is cut back only every few tokens: ~1.1 decode calls per token, not 2.
    ids = enc(real, (UNICODE_TEXT + " The quick brown fox jumps over the lazy dog. ") * 20)
    counting = Counting(real)
    deltas, tail = run(counting, ids, skip=True)
    assert joined(deltas) + tail == real.decode(ids, skip_special_tokens=True)
    assert len(counting.sizes) <= 1.25 * len(ids) + 1
    assert max(counting.sizes) <= 40


# --- stop strings ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_stop_string_across_token_boundaries(real: Tokenizer) -> None:
    par, is_, dot = one_token(real, "Par"), one_token(real, "is"), one_token(real, ".")
    ids = [*enc(real, "Answer:"), par, is_, dot, *enc(real, " More text")]
    stream = TextStream(real, ["Paris."], skip_special_tokens=True)
    before = [stream.push([t]) for t in ids[: ids.index(par)]]
    assert joined(before) == "Answer:"
    assert stream.push([par]) == TextDelta("", None, 1, 1)  # "Par" could start "Paris.": held
    assert stream.push([is_]) == TextDelta("", None, 1, 1)
    assert stream.push([dot]) == TextDelta("", "Paris.", 1, 1)
    assert stream.finish() == ""  # nothing after a stop string is ever emitted
    with pytest.raises(RuntimeError):
        stream.push(ids[-1:])


@pytest.mark.slow
def test_stop_string_at_the_very_start(real: Tokenizer) -> None:
    ids = enc(real, "Hello world")
    deltas, tail = run(real, ids, stops=["Hello"])
    assert deltas == [TextDelta("", "Hello", 1, 1)]
    assert tail == ""


@pytest.mark.slow
def test_several_tokens_at_once_with_the_match_in_the_middle(real: Tokenizer) -> None:
    par, is_, dot = one_token(real, "Par"), one_token(real, "is"), one_token(real, ".")
    head = enc(real, "Answer:")
    ids = [*head, par, is_, dot, *enc(real, " More text")]
    stream = TextStream(real, ["Paris."], skip_special_tokens=True)
    assert stream.push(ids) == TextDelta("Answer:", "Paris.", len(head) + 3, len(head) + 3)
    # The same, with the tokens of the match split over two pushes.
    stream = TextStream(real, ["Paris."], skip_special_tokens=True)
    assert stream.push([*head, par]) == TextDelta("Answer:", None, len(head) + 1, len(head) + 1)
    assert stream.push([is_, dot, *enc(real, " More")]) == TextDelta("", "Paris.", 2, 2)


@pytest.mark.slow
def test_held_text_is_released_when_the_candidate_fails(real: Tokenizer) -> None:
    par = one_token(real, "Par")
    stream = TextStream(real, ["Paris."], skip_special_tokens=True)
    assert stream.push([par]) == TextDelta("", None, 1, 1)
    rest = enc(real, "ty time")
    assert stream.push(rest) == TextDelta("Party time", None, len(rest), len(rest))
    # Held text at the end of the job comes out of finish().
    stream = TextStream(real, ["Paris."], skip_special_tokens=True)
    ids = [*enc(real, "Go to "), par, one_token(real, "is")]
    assert stream.push(ids) == TextDelta("Go to ", None, len(ids), len(ids))
    assert stream.finish() == "Paris"


@pytest.mark.slow
def test_overlapping_candidates(real: Tokenizer) -> None:
    chars = [one_token(real, c) for c in "xabc"]
    # "ab" completes before "abc" can: it wins, one token at a time or all at once.
    stream = TextStream(real, ["abc", "ab"], skip_special_tokens=True)
    assert [stream.push([t]) for t in chars[:3]] == [
        TextDelta("x", None, 1, 1),
        TextDelta("", None, 1, 1),
        TextDelta("", "ab", 1, 1),
    ]
    assert run(real, chars, stops=["abc", "ab"], chunks=[4])[0] == [TextDelta("x", "ab", 3, 3)]
    # A failed candidate whose tail starts a new one: "ab|a" -> release "ab", keep "a".
    ids = [one_token(real, c) for c in "ababc"]
    stream = TextStream(real, ["abc"], skip_special_tokens=True)
    assert [d.text for d in map(stream.push, [[t] for t in ids])] == ["", "", "ab", "", ""]
    # The first stop string to complete wins, even one inside another that started earlier.
    assert run(real, enc(real, "abcd"), stops=["abcd", "bc"], chunks=[9])[0][0].stop_string == "bc"


@pytest.mark.slow
def test_multiple_stop_strings_earliest_wins(real: Tokenizer) -> None:
    ids = enc(real, "hello world, goodbye")
    for stops in (["goodbye", "world", "lo w"], ["lo w", "world", "goodbye"]):
        deltas, tail = run(real, ids, stops=stops)
        assert joined(deltas) == "hel"
        assert deltas[-1].stop_string == "lo w"
        assert tail == ""
    deltas, _ = run(real, ids, stops=["goodbye", ", "], chunks=[3])
    assert (joined(deltas), deltas[-1].stop_string) == ("hello world", ", ")


@pytest.mark.slow
def test_stop_string_inside_a_split_character(real: Tokenizer) -> None:
    ids = enc(real, "a 日本語 b")
    deltas, tail = run(real, ids, stops=["本語"])
    assert (joined(deltas), deltas[-1].stop_string, tail) == ("a 日", "本語", "")
    stopped_at = sum(d.tokens_consumed for d in deltas)
    assert stable(real.decode(ids[:stopped_at])).endswith("本語")
    assert not stable(real.decode(ids[: stopped_at - 1])).endswith("本語")


ALPHABET = "ab .é🙂"


@pytest.mark.slow
@PROPERTY_SETTINGS
@given(
    text=st.text(ALPHABET, max_size=30),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=4),
)
def test_stop_strings_against_an_oracle(
    real: Tokenizer, text: str, stops: list[str], chunks: list[int]
) -> None:
    ids = enc(real, text)
    full = real.decode(ids)
    deltas, tail = run(real, ids, stops=stops, chunks=chunks)
    emitted = joined(deltas)
    assert FFFD not in emitted
    found = [(full.find(s) + len(s), -len(s), s) for s in stops if s in full]
    if not found:
        assert emitted + tail == full
        assert all(d.stop_string is None for d in deltas)
        return
    end, _, stop = min(found)  # the earliest to complete; at a tie the longest
    assert (emitted, deltas[-1].stop_string, tail) == (full[: end - len(stop)], stop, "")
    # The match is pinned to the first token whose (whole-character) text completes it.
    first = next(k for k in range(1, len(ids) + 1) if len(stable(real.decode(ids[:k]))) >= end)
    assert sum(d.tokens_consumed for d in deltas) == first


# --- special tokens -------------------------------------------------------------------------------


@pytest.mark.slow
def test_stop_string_matches_the_eos_text_when_special_tokens_are_decoded(real: Tokenizer) -> None:
    (eos,) = real.eos_token_ids
    assert real.decode([eos]) == "<|im_end|>"
    ids = [*enc(real, "Hi there"), eos, *enc(real, "more")]
    deltas, tail = run(real, ids, stops=["<|im_end|>"], skip=False, chunks=[len(ids)])
    assert deltas == [TextDelta("Hi there", "<|im_end|>", len(ids) - 1, len(ids) - 1)]
    assert tail == ""
    # Skipped, the EOS has no text, so the stop string cannot match it.
    deltas, tail = run(real, ids, stops=["<|im_end|>"], skip=True)
    assert joined(deltas) + tail == "Hi theremore"
    assert all(d.stop_string is None for d in deltas)


def test_special_tokens_between_words(tiny: HFTokenizer) -> None:
    w1, w2, w3 = enc(tiny, "w1 w2 w3")
    (eos,) = tiny.eos_token_ids
    ids = [w1, eos, w2, eos, eos, w3]
    for skip in (True, False):
        deltas, tail = run(tiny, ids, skip=skip)
        assert joined(deltas) + tail == tiny.decode(ids, skip_special_tokens=skip)
    assert tiny.decode(ids, skip_special_tokens=True) == "w1 w2 w3"
    # Skipped, "</s>" is no text: a stop string on it never matches, one across it does.
    deltas, _ = run(tiny, ids, stops=["</s>"], skip=True)
    assert all(d.stop_string is None for d in deltas)
    assert run(tiny, ids, stops=["w1 w2"], skip=True, chunks=[6])[0] == [TextDelta("", "w1 w2", 3, 3)]
    # Decoded, it is text like any other.
    assert run(tiny, ids, stops=["</s>"], skip=False, chunks=[6])[0] == [TextDelta("w1 ", "</s>", 2, 2)]


def test_long_run_of_skipped_special_tokens(tiny: HFTokenizer) -> None:
    (eos,) = tiny.eos_token_ids
    w1, w2 = enc(tiny, "w1 w2")
    ids = [w1, *[eos] * 40, w2]
    for skip in (True, False):
        deltas, tail = run(tiny, ids, skip=skip)
        assert joined(deltas) + tail == tiny.decode(ids, skip_special_tokens=skip)


@pytest.mark.slow
@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_inside_a_split_character(real: Tokenizer, skip: bool) -> None:
    (eos,) = real.eos_token_ids
    lead, *rest = enc(real, "🎉")
    for count in (1, 40):
        ids = [*enc(real, "a"), lead, *[eos] * count, *rest, *enc(real, "b")]
        deltas, tail = run(real, ids, skip=skip)
        full = real.decode(ids, skip_special_tokens=skip)
        assert joined(deltas) + tail == full
        assert ("🎉" in full) == skip  # skipped, the EOS leaves the bytes of the emoji adjacent


# --- API edges ------------------------------------------------------------------------------------


def test_api_edges(tiny: HFTokenizer) -> None:
    stream = TextStream(tiny, ["w2"], skip_special_tokens=True)
    assert stream.push([]) == TextDelta("", None, 0, 0)
    assert stream.finish() == ""
    assert stream.finish() == ""
    with pytest.raises(RuntimeError):
        stream.push(enc(tiny, "w1"))
    with pytest.raises(ValueError, match="empty"):
        TextStream(tiny, ["w1", ""], skip_special_tokens=True)
    with pytest.raises(TypeError):
        TextStream(tiny, "w1", skip_special_tokens=True)
    # Duplicate stop strings are harmless.
    assert run(tiny, enc(tiny, "w1 w2"), stops=["w2", "w2"])[0][-1] == TextDelta(" ", "w2", 1, 1)
