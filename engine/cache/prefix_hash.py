"""A page's prefix identity: the hash chained over everything before it, rooted in the cache salt.

`h_i = chain_hash(h_{i-1}, tokens of page i)`, the first page's parent being `salt_root(salt)`
(None without a salt). The hash only proposes a hit: the page pool also checks the exact tokens on
the exact parent registration (engine/cache/pages.py), so a collision costs at most a missed hit.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Sequence


def chain_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The prefix hash of a page holding `tokens` after the page hashed `parent` (None: first page).

    blake2b (64-bit digest) rather than Python's tuple hash: about 1 us per 16-token
    page, the same in every process and Python version (so it can leave the process,
    e.g. for prefix-aware routing), and callers cannot steer it to make their pages
    displace someone else's in the index, as they could with `hash()` of ints.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "little"))
    h.update(array.array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def salt_root(salt: str) -> int | None:
    """The parent hash of a first page under `salt` (None for no salt: today's hashes)."""
    if not salt:
        return None
    h = hashlib.blake2b(digest_size=8, person=b"dyngen-salt")
    h.update(salt.encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "little")


def extend_chain(hashes: list[int], tokens: Sequence[int], page_size: int, salt: str, pages: int) -> None:
    """Append the chain hashes of pages `len(hashes)..pages-1` of `tokens` (a sequence's hash cache).

    Valid for as long as the sequence's tokens only grow, so a caller hashes each page once.
    """
    parent = hashes[-1] if hashes else salt_root(salt)
    for i in range(len(hashes), pages):
        parent = chain_hash(parent, tokens[i * page_size : (i + 1) * page_size])
        hashes.append(parent)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
