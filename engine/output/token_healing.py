"""Token healing: a prompt that ends mid-word gets its last word fragment back as a choice.

A tokenizer splits "...over the la" as [..., " la"] and "...is Pyt" as [..., " Py", "t"]:
pieces the model seldom saw mid-word, since it was trained on " lazy" and " Python".
Healing takes the trailing fragment back (the last token, and the tokens before it while
they continue the same word, at most `MAX_TOKENS`) and makes the output spell it again
first: while some of the taken-back text is left to spell, a token is allowed only if its
text starts with what is left (" lazy" for " la") or is a leading part of it (" Py" for
" Pyt"). So the model picks the word it would have written after the whole word's start.
The output stream leaves the taken-back text out: the caller sees "zy", not " lazy".

Matching is on the tokens' bytes (llguidance's view of the vocabulary, which the grammar
engine builds anyway), sorted once, so the tokens starting with a text are one contiguous
range found by bisection.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import llguidance
import torch

from engine.grammar.constraints import mask_words
from engine.model.tokenizer import Tokenizer

MAX_TOKENS = 4  # trailing tokens taken back at most
MAX_BYTES = 32  # and at most this much text
_REPLACEMENT = "\ufffd"
_CACHED_MASKS = 64


@dataclass(frozen=True)
class HealPlan:
    """A healed job: its prompt less the taken-back tokens, and their text (bytes for matching
    tokens, characters for the output stream to leave out)."""

    prompt_ids: tuple[int, ...]
    removed_text: str
    removed: bytes


def _continues_word(byte: int) -> bool:
    """A byte that can sit inside a word: an ASCII letter or digit, or part of a non-ASCII character."""
    return byte >= 0x80 or chr(byte).isalnum()


class TokenHealer:
    """Plans healing for one tokenizer; the sorted vocabulary is built on first use (thread-safe)."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, ll_tokenizer: Callable[[], llguidance.LLTokenizer]
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._ll_tokenizer = ll_tokenizer
        self._lock = threading.Lock()
        self._bytes: list[bytes] = []  # token id -> its bytes (b"" for special tokens)
        self._sorted: list[bytes] = []
        self._ids: list[int] = []  # token ids in the order of _sorted
        self._masks: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def plan(self, prompt_ids: Sequence[int]) -> HealPlan | None:
        """The healed job's plan, or None where there is nothing to heal: a one-token prompt, a
        special last token, or a fragment whose text is not whole characters."""
        self._build()
        if len(prompt_ids) < 2 or not all(0 <= t < self._vocab_size for t in prompt_ids[-MAX_TOKENS:]):
            return None
        cut = len(prompt_ids) - 1
        removed = self._bytes[prompt_ids[cut]]
        if not removed:
            return None
        # Take earlier tokens back while the fragment continues their word.
        while cut > 1 and len(prompt_ids) - cut < MAX_TOKENS:
            before = self._bytes[prompt_ids[cut - 1]]
            if (
                not before
                or not _continues_word(removed[0])
                or not _continues_word(before[-1])
                or len(before) + len(removed) > MAX_BYTES
            ):
                break
            removed = before + removed
            cut -= 1
        text = self._tokenizer.decode(prompt_ids[cut:], skip_special_tokens=False)
        if not text or _REPLACEMENT in text:
            return None
        return HealPlan(tuple(prompt_ids[:cut]), text, removed)

    def remaining(self, left: bytes, output: Sequence[int]) -> bytes:
        """What of the taken-back text is yet to spell after `output`, if `left` was before it."""
        for token in output:
            if not left:
                break
            b = self._bytes[token] if 0 <= token < len(self._bytes) else b""
            left = left[len(b) :] if left.startswith(b) and b else b""
        return left

    def mask(self, left: bytes) -> torch.Tensor:
        """int32 bitmask [ceil(vocab / 32)] of the tokens that may come next while `left` is unspelled:
        those starting with it and those that are a leading part of it."""
        with self._lock:
            cached = self._masks.get(left)
            if cached is not None:
                self._masks.move_to_end(left)
                return cached
        lo = bisect.bisect_left(self._sorted, left)
        hi = lo
        while hi < len(self._sorted) and self._sorted[hi].startswith(left):
            hi += 1
        ids = list(self._ids[lo:hi])
        for n in range(1, len(left)):
            at = bisect.bisect_left(self._sorted, left[:n])
            while at < len(self._sorted) and self._sorted[at] == left[:n]:
                ids.append(self._ids[at])
                at += 1
        words = _bitmask(ids, self._vocab_size)
        with self._lock:
            self._masks[left] = words
            if len(self._masks) > _CACHED_MASKS:
                self._masks.popitem(last=False)
        return words

    def _build(self) -> None:
        with self._lock:
            if self._bytes:
                return
            ll = self._ll_tokenizer()
            table = [
                b"" if ll.is_special_token(t) else bytes(ll.decode_bytes([t]))
                for t in range(self._vocab_size)
            ]
            pairs = sorted((b, t) for t, b in enumerate(table) if b)
            self._sorted = [b for b, _ in pairs]
            self._ids = [t for _, t in pairs]
            self._bytes = table


def _bitmask(ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """int32 words with bit t of word t // 32 set for each id."""
    t = torch.tensor(sorted(set(ids)), dtype=torch.long)
    words = torch.zeros(mask_words(vocab_size), dtype=torch.int64)
    # Distinct ids: each (word, bit) pair is added once, so the sums carry nothing.
    words.index_add_(0, t // 32, torch.ones_like(t) << (t % 32))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
