"""KV cache groups: how the layers of a model with several attention windows share one pool.
Plain Python, no torch.

A model whose layers all attend alike (all full, or all with one sliding window) is one
group: every layer stores each token, a block holds a token span of every layer. A hybrid
model (Gemma 2/3, gpt-oss, Cohere 2, ... : sliding-window layers next to full-attention
ones) is split, as vLLM's hybrid allocator does, into groups of equally many layers with one
window each: a block then holds a token span of one group's layers (`slots` of them), and
each group keeps its own block table per sequence. A sliding group's blocks go back to the
pool as the window passes them while the full groups keep theirs, so a 5:1 model holding
8K tokens with a 1K window stores about 27% of what one table for all layers would
(benchmarks/bench_hybrid_kv.py).

`GroupedTables` keeps the block tables of every group for a batch of rows, drawing on one
`BlockPool`; a one-group model's is exactly a `BlockTables`. Its device mirror has a row per
(group, row): row `g * num_rows + r`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .block_pool import BlockPool
from .block_table import AppendPlan, BlockTables, first_visible
from ..errors import KVCacheExhaustedError


@dataclass(frozen=True)
class KVGroups:
    """The groups of a model's layers.

    windows: per group, its sliding window (None: full attention).
    layers:  per group, its layers; layer `layers[g][s]` lives in slot s of group g's
             blocks (a group may be shorter than `slots`: those slots stay unused).
    slots:   layers per block.
    """

    windows: tuple[int | None, ...]
    layers: tuple[tuple[int, ...], ...]
    slots: int

    @classmethod
    def plan(cls, layer_windows: Sequence[int | None], hybrid: bool = True) -> "KVGroups":
        """Groups for layers with these windows. Groups have the size of the smallest set
        of layers sharing a window (Gemma 3's 5:1 pattern over 6 layers: 6 groups of 1;
        gpt-oss's 1:1 over 24: 2 groups of 12). hybrid=False: one group of all layers, which
        releases nothing unless every layer has the same window."""
        layer_windows = tuple(layer_windows)
        distinct = list(dict.fromkeys(layer_windows))
        if not hybrid or len(distinct) <= 1:
            window = distinct[0] if len(distinct) == 1 else None
            return cls((window,), (tuple(range(len(layer_windows))),), len(layer_windows))
        by_window = {w: [i for i, lw in enumerate(layer_windows) if lw == w] for w in distinct}
        size = min(len(layers) for layers in by_window.values())
        windows, groups = [], []
        for w in sorted(distinct, key=lambda w: (w is not None, w or 0)):  # full first
            members = by_window[w]
            for start in range(0, len(members), size):
                windows.append(w)
                groups.append(tuple(members[start:start + size]))
        return cls(tuple(windows), tuple(groups), size)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_layers(self) -> int:
        return sum(len(g) for g in self.layers)

    @property
    def is_hybrid(self) -> bool:
        return self.num_groups > 1

    @property
    def slides(self) -> bool:
        """Some group has a sliding window (blocks can leave it)."""
        return any(w is not None for w in self.windows)

    def where(self) -> list[tuple[int, int]]:
        """Per layer, (its group, its slot)."""
        out = [(0, 0)] * self.num_layers
        for g, layers in enumerate(self.layers):
            for s, layer in enumerate(layers):
                out[layer] = (g, s)
        return out

    def model_blocks(self, pool_blocks: int, round_up: bool = False) -> int:
        """Pool blocks (each of `slots` layers) as blocks of every layer: the unit of
        `num_blocks` and of `memory_stats()` (the same number for one group)."""
        scaled = pool_blocks * self.slots
        return -(-scaled // self.num_layers) if round_up else scaled // self.num_layers

    def pool_blocks(self, model_blocks: int) -> int:
        """The pool blocks that hold `model_blocks` blocks of every layer (rounded up, so
        that `model_blocks` reads them back as that many)."""
        return -(-model_blocks * self.num_layers // self.slots)

    def in_model_blocks(self, err: KVCacheExhaustedError, held: int) -> KVCacheExhaustedError:
        """`err` (counted in pool blocks) counted in blocks of every layer; held: the
        failing cache's pool blocks."""
        return KVCacheExhaustedError(
            self.model_blocks(err.needed, True), self.model_blocks(err.free),
            self.model_blocks(err.num_blocks), err.block_size, self.model_blocks(held, True))

    def blocks_for(self, tokens: int, block_size: int, chunk: int = 1) -> int:
        """Most blocks, over all groups, a sequence of `tokens` holds at once when it is
        computed `chunk` tokens at a time (a sliding group keeps its window plus a chunk,
        which may straddle one block more once it has slid; before, it holds every block
        from the first)."""
        total = 0
        for window in self.windows:
            held = tokens if window is None else min(tokens, window + chunk)
            total += -(-held // block_size) + (held < tokens)
        return total


class GroupedTables:
    """Block tables of `num_rows` rows in every group of a `KVGroups`, one `BlockPool`.

    Rows grow, fork, shrink and are freed in every group at once (each group's tables hold
    the same token lengths); a sliding group releases the blocks its window has passed.
    The single-group attributes `tables`, `lengths` and `freed` are group 0's.
    """

    def __init__(self, pool: BlockPool, groups: KVGroups, num_rows: int = 0):
        self.pool = pool
        self.groups = groups
        self.block_size = pool.block_size
        self.by_group = [BlockTables(pool, num_rows) for _ in groups.windows]

    # -- group 0's view (what a one-group model's callers read) -------------------------------
    @property
    def tables(self) -> list[list[int]]:
        return self.by_group[0].tables

    @property
    def lengths(self) -> list[int]:
        return self.by_group[0].lengths

    @property
    def freed(self) -> list[int]:
        return self.by_group[0].freed

    @property
    def num_rows(self) -> int:
        return self.by_group[0].num_rows

    @property
    def num_held(self) -> int:
        return sum(t.num_held for t in self.by_group)

    def device_row(self, group: int, row: int) -> int:
        """The row of (group, row) in the device mirror."""
        return group * self.num_rows + row

    def row_tables(self, row: int) -> list[list[int]]:
        """The row's block table in each group."""
        return [t.tables[row] for t in self.by_group]

    # -- growth -------------------------------------------------------------------------------
    def blocks_needed(self, counts: Sequence[int]) -> int:
        return sum(t.blocks_needed(counts) for t in self.by_group)

    def append(self, counts: Sequence[int], needed: int | None = None) -> AppendPlan:
        """Room for `counts[r]` more tokens in each row of every group (all or nothing);
        entries name device rows (`device_row`)."""
        if needed is None:
            needed = self.blocks_needed(counts)
        if needed > self.pool.num_free:
            raise KVCacheExhaustedError(needed, self.pool.num_free, self.pool.num_blocks,
                                        self.block_size)
        if len(self.by_group) == 1:
            return self.by_group[0].append(counts, needed)
        plan = AppendPlan()
        rows = self.num_rows
        for g, tables in enumerate(self.by_group):
            part = tables.append(counts)
            plan.entries += [(g * rows + r, c, b) for r, c, b in part.entries]
            plan.copies += part.copies
        return plan

    def release_outside_window(self, lengths: Sequence[int] | None = None) -> list[int]:
        """In each sliding group, releases the blocks no next query of a row holding
        `lengths[r]` tokens (default: the table lengths) can see; returns them."""
        released: list[int] = []
        for window, tables in zip(self.groups.windows, self.by_group):
            if window is not None:
                released += tables.release_outside_window(window, lengths)
        return released

    def released_any(self) -> bool:
        """Whether any row of any group has released blocks."""
        return any(any(t.freed) for t in self.by_group)

    def cannot_keep(self, lengths: Sequence[int]) -> bool:
        """Whether truncating rows to `lengths` needs tokens a window already released."""
        for window, tables in zip(self.groups.windows, self.by_group):
            if window is not None and any(
                    f and first_visible(n, window) < f * self.block_size
                    for n, f in zip(lengths, tables.freed)):
                return True
        return False

    # -- structure ----------------------------------------------------------------------------
    def fork_rows(self, src_rows: Sequence[int]) -> None:
        for tables in self.by_group:
            tables.fork_rows(src_rows)

    def truncate(self, new_lengths: Sequence[int]) -> None:
        for tables in self.by_group:
            tables.truncate(new_lengths)

    def free_row(self, row: int) -> list[int]:
        return [b for tables in self.by_group for b in tables.free_row(row)]

    def truncate_row(self, row: int, length: int) -> list[int]:
        return [b for tables in self.by_group for b in tables.truncate_row(row, length)]

    def assign(self, row: int, blocks: Sequence[Sequence[int]], length: int,
               incref: bool = True) -> list[tuple[int, int, int]]:
        """Fills the empty `row` of each group g with `blocks[g]` (see
        `BlockTables.assign`); returns the device-table entries to write."""
        entries = []
        for g, (tables, table) in enumerate(zip(self.by_group, blocks)):
            tables.assign(row, table, length, incref)
            entries += [(self.device_row(g, row), i, b) for i, b in enumerate(table) if b >= 0]
        return entries

    def release(self, later: bool = False) -> None:
        for tables in self.by_group:
            tables.release(later)

    def resize(self, num_rows: int) -> None:
        for tables in self.by_group:
            tables.resize(num_rows)
