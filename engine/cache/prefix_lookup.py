"""Matching tokens against the page pool's registered pages: what a registration records, and the lookups.

Prefix identity. A full page's hash chains over everything before it,
`h_i = chain_hash(h_{i-1}, tokens of page i)`, and finds candidates in a dict. The
hash alone does not decide a hit: every registration also records its exact tokens
and the registration it was computed on top of (a serial number never reused), and a
hit must match both. So by induction a matched page's KV was computed over exactly the
caller's prefix, whatever the hash does; a collision costs at most a missed hit.
(Checking only the page's own tokens would not suffice: the parent would then be
identified by its hash alone.) Hence `PagePool.register_full` takes the parent page, not its hash.

Cache salts (tenant isolation). A job's non-empty `salt` roots its chain: its first
page's parent hash is `salt_root(salt)` instead of None, and every registration records
its salt, which a hit and a dedup must match exactly too. So jobs of different salts
never share a page, even on a hash collision; an empty salt hashes as before.

The lookups only read the pool's maps (passed in); the pool (engine/cache/pages.py) owns and writes them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.cache.prefix_hash import chain_hash, common_prefix_len, salt_root
from engine.ids import PageId

ROOT_SERIAL = 0  # the "parent registration" of every first page
_PARTIAL_SCAN = 64  # children of one parent `find_partial` compares, newest first


@dataclass(frozen=True)
class PageKey:
    """What a registered (full) page holds: its chained hash, its parent's hash and its tokens."""

    hash: int
    parent_hash: int | None  # None for a first page without a salt
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Registration:
    key: PageKey
    serial: int  # unique for the pool's lifetime: names this content, not this page slot
    parent_serial: int
    salt: str  # the chain's salt, the same on every page of a chain


def find_chain(
    index: Mapping[int, PageId],
    regs: Mapping[PageId, Registration],
    token_ids: Sequence[int],
    limit: int,
    page_size: int,
    *,
    salt: str,
    hashes: Sequence[int] | None,
) -> list[PageId]:
    """The longest run of registered leading full pages of `token_ids[:limit]` (`index`: hash -> page).

    `hashes`: the sequence's chain hashes of its leading full pages, if the caller has them.
    """
    ps = page_size
    matched: list[PageId] = []
    parent_hash = salt_root(salt)
    parent_serial = ROOT_SERIAL
    for i, start in enumerate(range(0, limit - ps + 1, ps)):
        tokens = tuple(token_ids[start : start + ps])
        h = hashes[i] if hashes is not None and i < len(hashes) else chain_hash(parent_hash, tokens)
        page = index.get(h)
        if page is None:
            break
        reg = regs[page]
        # The hash only proposes; exact tokens on top of the exact parent (and salt) decide.
        # This also rules out a page matching twice (its parent chain ends at the root once).
        if reg.key.tokens != tokens or reg.parent_serial != parent_serial or reg.salt != salt:
            break
        matched.append(page)
        parent_hash, parent_serial = h, reg.serial
    return matched


def find_partial(
    children: Mapping[int, OrderedDict[PageId, None]],
    regs: Mapping[PageId, Registration],
    parent: PageId | None,
    tokens: Sequence[int],
    *,
    salt: str,
) -> tuple[PageId, int] | None:
    """The registered page on top of `parent` (None: a first page) whose leading tokens match the
    most of `tokens`, and how many (`children`: parent serial -> its registered pages, newest last).

    Looks at the newest `_PARTIAL_SCAN` children: a bound on the work per admission, not on correctness.
    """
    if not tokens:
        return None
    serial = ROOT_SERIAL
    if parent is not None:
        reg = regs.get(parent)
        if reg is None:
            raise ValueError(f"parent page {parent} is not registered")
        serial = reg.serial
    siblings = children.get(serial)
    if not siblings:
        return None
    best: tuple[PageId, int] | None = None
    for i, page in enumerate(reversed(siblings)):
        if i >= _PARTIAL_SCAN:
            break
        reg = regs[page]
        if reg.salt != salt:
            continue
        n = common_prefix_len(reg.key.tokens, tokens)
        if n and (best is None or n > best[1]):
            best = (page, n)
    return best
