"""Per-job text stream: generated token ids in, streamable text deltas out.

Three stages, each O(recent tokens + longest stop string) per token, never O(output):

1. Detokenizing (`detokenizer.Detokenizer`): a small window of tokens is decoded, and a trailing
   U+FFFD run (a character not yet complete) is held until a later token completes it.
2. Stop strings (`stop_matcher.StopMatcher`): an Aho-Corasick automaton over the stop strings
   holds back exactly the text that could still start one, and reports the first to complete.
3. Banned strings (optional). A second automaton holds back whole tokens while their text
   could still become a banned string; the tokens before the held run are released. If a
   banned string completes, push reports the output token it started in and the stream
   accepts no more tokens until `rewind` takes it back to just before that token (the
   generator then bans that token there and samples again). Held text and tokens are never
   released, so a banned string is never streamed, even in part. Banned strings are checked
   before stop strings: the stop matcher only ever sees released text.

Token healing drops the first characters of the output (`skip_prefix`: the text of the prompt
token the generator took back and regenerated), so callers see only what the prompt lacked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.model.tokenizer import Tokenizer
from engine.output.detokenizer import Detokenizer
from engine.output.stop_matcher import AhoCorasick, StopMatcher


@dataclass(frozen=True, slots=True)
class BannedMatch:
    """A banned string completed; the output must be rewound to before output token `token`."""

    token: int  # index among the output tokens pushed so far (0 = the first output token)
    string: str


@dataclass(frozen=True, slots=True)
class TextDelta:
    """What one push made safe to show."""

    text: str  # whole characters only, never reaching into a stop string or a possible one
    stop_string: str | None  # the stop string that matched; `text` ends right before it
    tokens_consumed: int  # pushed tokens up to the one completing the match (all of them if none)
    # Output tokens whose text is now final, oldest held first: the tokens to stream with `text`.
    # Equal to tokens_consumed without banned strings; fewer while a banned string may be forming.
    released: int = 0
    banned: BannedMatch | None = None  # set: call rewind(banned.token) before pushing again


@dataclass(frozen=True, slots=True)
class _Held:
    """A pushed token whose text is held back, and the stream's state before it was pushed."""

    piece: str
    detok: tuple[tuple[int, ...], int, int, int]
    ban_state: int
    skip: str


class TextStream:
    """One job's token ids -> text deltas, UTF-8 safe, cut at the first stop string.

    Mutable and owned by its job. After a push reports a stop string, or after finish(),
    the stream is closed: push raises and finish returns "".
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop_strings: Sequence[str],
        skip_special_tokens: bool,
        banned_strings: Sequence[str] = (),
        skip_prefix: str = "",
    ) -> None:
        for name, strings in (("stop_strings", stop_strings), ("banned_strings", banned_strings)):
            if isinstance(strings, str):  # a str is a Sequence[str]: each character would be one
                raise TypeError(f"{name} must be a sequence of strings, not one string")
            if any(not s for s in strings):
                raise ValueError(f"{name} must not hold an empty string")
        self._detok = Detokenizer(tokenizer, skip_special_tokens)
        self._stops = StopMatcher(stop_strings)
        self._bans = AhoCorasick(banned_strings) if banned_strings else None
        self._ban_state = 0
        self._held: list[_Held] = []
        self._skip = skip_prefix
        self._pushed = 0  # output tokens pushed and not rewound
        self._must_rewind = False
        self._closed = False
        # The stop string the held-back text completed at finish (text held for a banned string
        # that might follow reaches the stop strings only then); None when it completed none.
        self.finish_stop: str | None = None

    @property
    def held(self) -> int:
        """Output tokens pushed but not yet released (always 0 without banned strings)."""
        return len(self._held)

    def push(self, token_ids: Sequence[int]) -> TextDelta:
        """Accept new tokens (several at once under speculative decoding)."""
        if self._closed:
            raise RuntimeError("push on a TextStream that already stopped or finished")
        if self._must_rewind:
            raise RuntimeError("push after a banned string matched, before rewind")
        parts: list[str] = []
        released = 0
        # Token by token, so a match is pinned to the token that completes it.
        for consumed, token in enumerate(token_ids, start=1):
            if self._bans is None:
                self._pushed += 1
                released += 1
                pieces: list[str] = [self._skipped(self._detok.step(token))]
            else:
                held = _Held("", self._detok.save(), self._ban_state, self._skip)
                self._pushed += 1
                piece = self._skipped(self._detok.step(token))
                match = self._hold(_Held(piece, held.detok, held.ban_state, held.skip))
                if isinstance(match, BannedMatch):
                    self._must_rewind = True
                    return TextDelta("".join(parts), None, consumed, released, match)
                pieces = match
            for piece in pieces:
                if self._bans is not None:
                    released += 1
                if not piece:
                    continue
                out, stop = self._stops.feed(piece)
                parts.append(out)
                if stop is not None:
                    self._closed = True
                    return TextDelta("".join(parts), stop, consumed, released)
        return TextDelta("".join(parts), None, len(token_ids), released)

    def rewind(self, token: int) -> None:
        """Take back output tokens `token` and later (they must still be held): the stream is as it
        was before token `token` was pushed."""
        first = self._pushed - len(self._held)
        if not first <= token < self._pushed:
            raise ValueError(f"can rewind only to a held token, in [{first}, {self._pushed}), not to {token}")
        at = self._held[token - first]
        self._detok.restore(at.detok)
        self._ban_state, self._skip = at.ban_state, at.skip
        del self._held[token - first :]
        self._pushed = token
        self._must_rewind = False

    def commit(self) -> None:
        """The tokens pushed so far were delivered already (a job re-created after an engine restart
        replays them): they are final. Their held text goes on to the stop strings, as it did when it
        was delivered, and no rewind reaches back into them; a banned string that would complete
        across them still rewinds the tokens after them."""
        if self._bans is None or self._closed:
            return
        for h in self._held:
            if h.piece and self._stops.feed(h.piece)[1] is not None:
                self._closed = True  # a stop string completed: the job had ended there
                break
        self._held = []

    def finish(self) -> str:
        """Release the held-back text at the end of a job that no stop string ended so far. That
        text may complete a stop string after all (`finish_stop`): it is cut there."""
        if self._closed:
            return ""
        self._closed = True
        # The flushed tail holds only U+FFFD (a genuine one, or an unfinished character),
        # which can complete a stop or banned string only if the caller put U+FFFD in one.
        tail = "".join(h.piece for h in self._held) + self._skipped(self._detok.flush())
        self._held = []
        if self._bans is not None:
            cut = min((i for s in self._bans.strings if (i := tail.find(s)) >= 0), default=len(tail))
            tail = tail[:cut]
        released, stop = self._stops.feed(tail)
        self.finish_stop = stop
        return released if stop is not None else released + self._stops.release()

    def _skipped(self, piece: str) -> str:
        """`piece` less what is left of the healed prefix."""
        if not self._skip or not piece:
            return piece
        n = min(len(self._skip), len(piece))
        if piece[:n] != self._skip[:n]:  # the output left the prefix: nothing more to drop
            self._skip = ""
            return piece
        self._skip = self._skip[n:]
        return piece[n:]

    def _hold(self, new: _Held) -> BannedMatch | list[str]:
        """Add a token to the held run; return the pieces of the tokens released from its front, or
        the banned match it completed."""
        bans = self._bans
        assert bans is not None
        self._held.append(new)
        before = sum(len(h.piece) for h in self._held[:-1])
        state = self._ban_state
        for i, ch in enumerate(new.piece):
            state = bans.step(state, ch)
            found = bans.match[state]
            if found >= 0:
                # A match starting in committed text rewinds to the first token after it.
                start = max(before + i + 1 - len(bans.strings[found]), 0)
                return BannedMatch(
                    self._pushed - len(self._held) + self._token_at(start), bans.strings[found]
                )
        self._ban_state = state
        keep_from = before + len(new.piece) - bans.depth[state]
        if not bans.depth[state]:
            n = len(self._held)
        elif keep_from > 0:
            n = self._token_at(keep_from)
        else:  # the text that may start a banned string reaches into committed text
            n = 0
        # Textless tokens just before the held run (bytes of a character not yet complete, say)
        # belong with it: the character they start may start a banned string.
        while n > 0 and not self._held[n - 1].piece:
            n -= 1
        out = [h.piece for h in self._held[:n]]
        del self._held[:n]
        return out

    def _token_at(self, char: int) -> int:
        """Index in the held run of the token whose text holds held character `char`, moved back
        over the textless tokens right before it."""
        pos = 0
        for at, h in enumerate(self._held):
            if h.piece and pos <= char < pos + len(h.piece):
                k = at
                while k > 0 and not self._held[k - 1].piece:
                    k -= 1
                return k
            pos += len(h.piece)
        raise AssertionError(f"held character {char} is past the held text")
