"""The page pool's invariants, checked against every live page table (`PagePool.check_invariants`,
which hands over a PoolView of its state: this module knows no PagePool, so no import cycle).

For tests and debug checks, not the serving path: it walks every page. It reads the pool's state
and changes nothing, so it sits apart from the operations that keep the invariants.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.cache.prefix_hash import chain_hash, salt_root
from engine.cache.prefix_lookup import ROOT_SERIAL, Registration
from engine.ids import PageId


@dataclass(frozen=True)
class PoolView:
    """The pool's state, read only (the pool's own containers, not copies)."""

    num_pages: int
    page_size: int
    ref: list[int]
    free: list[PageId]
    lru: OrderedDict[PageId, None]
    reg: dict[PageId, Registration]
    index: dict[int, PageId]
    children: dict[int, OrderedDict[PageId, None]]


def check_pool_invariants(
    pool: PoolView, tables: Iterable[Sequence[PageId]], holds: Iterable[PageId] = ()
) -> None:
    """Raise AssertionError listing every broken invariant, given all live page tables and the
    pages held outside them (`hold`: a partial prefix's source page, until it is copied)."""
    problems: list[str] = []
    n = pool.num_pages
    holders = [0] * n
    for page in holds:
        holders[page] += 1
    for t, table in enumerate(tables):
        seen: set[PageId] = set()
        for page in table:
            if not 0 <= page < n:
                problems.append(f"table {t} holds page {page}, outside 0..{n - 1}")
                continue
            if page in seen:
                problems.append(f"table {t} holds page {page} twice")
            seen.add(page)
            holders[page] += 1
        problems.extend(_table_chain_problems(pool, t, table))
    free = set(pool.free)
    if len(free) != len(pool.free):
        problems.append("the free list holds a page twice")
    for p in range(n):
        page = PageId(p)
        ref, reg = pool.ref[p], pool.reg.get(page)
        states = [name for name, on in (("FREE", page in free), ("CACHED", page in pool.lru)) if on]
        if ref > 0:
            states.append("REFERENCED")
        if len(states) != 1:
            problems.append(f"page {p} is in {len(states)} states {states} (ref count {ref})")
        if ref != holders[p]:
            problems.append(f"page {p} has ref count {ref} but {holders[p]} tables hold it")
        if page in free and reg is not None:
            problems.append(f"FREE page {p} still has a hash")
        if page in pool.lru and (reg is None or pool.index.get(reg.key.hash) != page):
            problems.append(f"CACHED page {p} cannot be found by its hash")
        if reg is not None:
            key = reg.key
            if len(key.tokens) != pool.page_size:
                problems.append(f"page {p} is registered with {len(key.tokens)} tokens")
            if key.hash != chain_hash(key.parent_hash, key.tokens):
                problems.append(f"page {p}'s hash does not match its parent hash and tokens")
            if reg.parent_serial == ROOT_SERIAL and key.parent_hash != salt_root(reg.salt):
                problems.append(f"first page {p}'s parent hash is not its salt's root")
            if reg.parent_serial != ROOT_SERIAL and key.parent_hash is None:
                problems.append(f"page {p} disagrees with itself on whether it is a first page")
    for h, page in pool.index.items():
        reg = pool.reg.get(page)
        if reg is None or reg.key.hash != h:
            problems.append(f"the index maps hash {h:#x} to page {page}, not registered under it")
    children = {(serial, page) for serial, pages in pool.children.items() for page in pages}
    if children != {(reg.parent_serial, page) for page, reg in pool.reg.items()}:
        problems.append("the children index does not list exactly the registered pages")
    if len({reg.serial for reg in pool.reg.values()}) != len(pool.reg):
        problems.append("two registrations share a serial")
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise AssertionError("page pool invariants broken:\n  " + "\n  ".join(shown))


def _table_chain_problems(pool: PoolView, t: int, table: Sequence[PageId]) -> list[str]:
    """Registered pages must be a prefix of the table, each on top of the table's previous page."""
    parent_serial = ROOT_SERIAL
    unregistered_at: int | None = None
    for i, page in enumerate(table):
        reg = pool.reg.get(page) if 0 <= page < pool.num_pages else None
        if reg is None:
            unregistered_at = i if unregistered_at is None else unregistered_at
            continue
        if unregistered_at is not None:
            return [
                f"table {t}: page {page} at {i} is registered after unregistered page at {unregistered_at}"
            ]
        if reg.parent_serial != parent_serial:
            return [f"table {t}: page {page} at {i} was registered on top of another page than the table's"]
        parent_serial = reg.serial
    return []
