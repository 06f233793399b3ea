"""The isolation debug mode (HF_PAGED_DEBUG=1): before each forward, every block it touches
is checked against the scheduler's books."""

from __future__ import annotations

from ..core.block_table import FREED
from ..core.scheduler import Scheduler
from ..errors import IsolationError
from ..kv.metadata import ForwardMetadata


def check_isolation(s: Scheduler, block_size: int, items: list,
                    metas: list[ForwardMetadata]) -> None:
    """Refcounts match the holders of every block; each scheduled sequence writes only into
    its own unshared blocks; the device table rows equal the scheduler's, in every KV group
    (`metas`: one per group). Raises IsolationError naming the first difference."""
    pool = s.pool
    holders: dict[int, int] = {}
    for tables in s.tables.by_group:
        for table in tables.tables:
            for b in table:
                if b != FREED:
                    holders[b] = holders.get(b, 0) + 1
    free = set(pool.free_blocks())
    for b in range(pool.num_blocks):
        expected = holders.get(b, 0) + s.prefix.holds(b)
        if pool.refcount(b) != expected or (b in free) != (expected == 0):
            raise IsolationError(f"block {b}: refcount {pool.refcount(b)}, holders "
                                 f"{expected}, free {b in free}")
    for tables, meta in zip(s.tables.by_group, metas):
        _check_group(s, tables, block_size, items, meta)


def _check_group(s: Scheduler, tables, block_size: int, items: list,
                 meta: ForwardMetadata) -> None:
    pool = s.pool
    slots = meta.slot_mapping.tolist()
    offset = 0
    for item in items:
        own = set(tables.tables[item.seq.row]) - {FREED}
        for slot in slots[offset:offset + item.count]:
            block = slot // block_size
            if block not in own:
                raise IsolationError(f"sequence {item.seq.seq_id} writes slot {slot} "
                                     f"outside its blocks {sorted(own)}")
            if pool.refcount(block) > 1 + s.prefix.holds(block):
                raise IsolationError(f"sequence {item.seq.seq_id} writes into shared "
                                     f"block {block}")
        offset += item.count
    for i, item in enumerate(items):
        table = meta.block_tables[i].tolist()
        row = tables.tables[item.seq.row]
        for col, block in enumerate(row):
            if block != FREED and col < len(table) and table[col] != block:
                raise IsolationError(f"device table of sequence {item.seq.seq_id} has "
                                     f"{table[col]} at {col}, the scheduler {block}")
