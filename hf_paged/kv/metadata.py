"""Per-forward paging metadata, built once per model forward and shared by all layers.

This is the contract between whoever plans a forward (generate's cache, the engine's model
runner) and the attention backends: `build_metadata` makes it (`decode_metadata`, a
decode step's, from a block table's host mirror), `kernels/` reads it.

The device copy of the block tables is kept in step with `BlockTables` incrementally:
new entries are scattered in, beam reorders gather rows; nothing is rebuilt from
Python lists on a decode step.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from ..errors import HFPagedError
from ..utils import cdiv


def to_device(values, device: torch.device) -> torch.Tensor:
    """int64 tensor of host `values` on `device`, without waiting for queued GPU work.

    (A pageable host->device copy is staged before the call returns, so it needs no sync.)
    """
    try:  # a flat list of ints through an array: three times faster than torch.tensor
        host = torch.frombuffer(array.array("q", values), dtype=torch.int64)
    except (TypeError, ValueError):  # nested (or empty) values
        host = torch.tensor(values, dtype=torch.int64)
    return host.to(device, non_blocking=True)


class DeviceBlockTable:
    """Device mirror of `BlockTables` (or of `GroupedTables`' groups): block ids
    [G * R, cols] int32, group g's rows at g * R .. (g + 1) * R, and the rows' real lengths
    [R] int64 (the same in every group).

    host_mirror: also keep the ids as host lists (`host[g * R + r]`, row r of group g), for
    metadata built on the host; such a table takes entries only (no `fork`)."""

    # The table is written in place; it is made outside inference mode so that a cache
    # started under torch.inference_mode() can continue under no_grad, and back.
    def __init__(self, num_rows: int, num_cols: int, device: torch.device, num_groups: int = 1,
                 host_mirror: bool = False):
        self.device = device
        self.num_groups = num_groups
        self.host = [[] for _ in range(num_groups * num_rows)] if host_mirror else None
        with torch.inference_mode(False):
            self.table = torch.zeros(num_groups * num_rows, max(num_cols, 1), dtype=torch.int32,
                                     device=device)
        self.lengths = torch.zeros(num_rows, dtype=torch.int64, device=device)

    @property
    def num_rows(self) -> int:
        return self.table.shape[0] // self.num_groups

    def group(self, g: int) -> torch.Tensor:
        """[R, cols] block ids of group g's rows (a view)."""
        rows = self.num_rows
        return self.table[g * rows:(g + 1) * rows]

    def ensure_cols(self, num_cols: int) -> None:
        if num_cols > self.table.shape[1]:
            with torch.inference_mode(False):
                grown = torch.zeros(
                    self.table.shape[0], max(num_cols, 2 * self.table.shape[1]),
                    dtype=torch.int32, device=self.device,
                )
                grown[:, : self.table.shape[1]] = self.table
            self.table = grown

    def apply(self, entries: Sequence[tuple[int, int, int]]) -> None:
        """Writes (row, col, block) entries recorded by `BlockTables.append`."""
        if not entries:
            return
        if len({(r, c) for r, c, _ in entries}) < len(entries):
            # A cell written twice in one step (a fork's shared block, then its copy): the
            # last entry holds. One write per cell: a GPU applies repeated indices in no order.
            entries = list({(r, c): (r, c, b) for r, c, b in entries}.values())
        self.ensure_cols(max(e[1] for e in entries) + 1)
        rows, cols, blocks = to_device(entries, self.device).T
        self.table[rows, cols] = blocks.to(torch.int32)
        if self.host is not None:
            for row, col, block in entries:
                ids = self.host[row]
                if col >= len(ids):
                    ids.extend([0] * (col + 1 - len(ids)))
                ids[col] = block

    def fork(self, src_rows: torch.Tensor) -> None:
        """Row i becomes old row src_rows[i] in every group (device-side mirror of
        `BlockTables.fork_rows`)."""
        if self.host is not None:
            raise HFPagedError("a block table mirrored on the host takes entries only")
        src_rows = src_rows.to(self.device)
        index = src_rows
        if self.num_groups > 1:
            offsets = torch.arange(self.num_groups, device=self.device) * self.num_rows
            index = (offsets.unsqueeze(1) + src_rows).reshape(-1)
        with torch.inference_mode(False):
            self.table = self.table.index_select(0, index.clone())
        self.lengths = self.lengths.index_select(0, src_rows)


@dataclass
class ForwardMetadata:
    """Where one forward's new tokens go and what each query may read: built once per model
    forward (by `build_metadata`, for both paths) and read by every layer's attention.

    The layout is per row (a sequence, or a batch row of generate): row r holds `counts[r]`
    new tokens, right-aligned in `q` query columns (left columns of shorter rows are
    padding). A packed forward's input holds only the real tokens, rows back to back.

    block_tables: [R, nb] int64   block tables cut to the columns in use
    block_tables_i32: [R, nb] int32, the same (a view of the device table, for kernels)
    context_lens: [R] int64       real tokens cached before this forward
    seq_lens:     [R] int64       real tokens cached after it
    query_pos:    [R, q] int64    sequence position of each query column (pads: below context)
    is_query:     [R, q] bool     False on left-padding columns; None when there is none
    slot_mapping: [N] int64       flat pool slot of each real new token
    token_index:  [N] int64       row of the flattened [R * q] right-aligned layout holding
                                  each real token, None when every column is real
    max_seq_len:  longest row after this forward (host int)
    num_new:      real new tokens, N (host int)
    packed:       the forward's input holds only real tokens, rows back to back ([1, N]);
                  token_index then places them in the [R * q] layout
    key_hidden:   [R, T] bool, True on stored slots no query may see (see generate/plan.py);
                  None when there are none (backends declare whether they read it)
    columns:      columns generate has seen after this forward; slot t of row r holds
                  column t + columns - seq_lens[r]
    seq_lens_host: seq_lens as a host list, when the builder knows it (lets the reference
                  backend group decode rows of similar lengths)
    query_lens_host: each row's new tokens as a host list, given with seq_lens_host (rows
                  with nothing cached before take the reference's causal path)
    parts:        for a packed forward mixing single-token rows (decodes) and longer ones
                  (prompt chunks), attention runs per part: (metadata of some rows, [n] int64
                  positions of their tokens in the packed input), so decode rows are not
                  padded to the longest chunk; None: one part, this metadata
    scratch:      per-forward memo of what backends derive once and share across layers
                  (masks, length groups); never part of the contract
    """

    block_tables: torch.Tensor
    block_tables_i32: torch.Tensor
    context_lens: torch.Tensor
    seq_lens: torch.Tensor
    query_pos: torch.Tensor
    is_query: torch.Tensor | None
    slot_mapping: torch.Tensor
    token_index: torch.Tensor | None
    max_seq_len: int
    block_size: int
    num_new: int = 0
    packed: bool = False
    key_hidden: torch.Tensor | None = None
    columns: int = 0
    seq_lens_host: list[int] | None = None
    query_lens_host: list[int] | None = None
    parts: list | None = None
    scratch: dict = field(default_factory=dict, repr=False)

    @property
    def num_keys(self) -> int:
        return self.block_tables.shape[1] * self.block_size

    @property
    def query_start_loc(self) -> torch.Tensor:
        """[R + 1] int64: where each row's tokens start among the N real new tokens (the
        variable-length layout: cumulative counts), derived when a kernel asks for it."""
        counts = self.seq_lens - self.context_lens
        return torch.cat([counts.new_zeros(1), counts.cumsum(0)])

    def to(self, device: torch.device) -> "ForwardMetadata":
        """This metadata on `device` (for the layers of a pool shard there): each tensor
        copied once, host fields shared, the per-forward scratch fresh."""
        if self.block_tables_i32.device == device:
            return self
        # A copy into host memory must be complete before the CPU reads it.
        non_blocking = device.type != "cpu"
        return self.map_tensors(lambda t: t.to(device, non_blocking=non_blocking))

    def map_tensors(self, fn) -> "ForwardMetadata":
        """A copy with `fn` applied to every tensor (parts included)."""
        def move(t):
            return None if t is None else fn(t)

        table = move(self.block_tables_i32)
        return replace(
            self, block_tables=table.long(), block_tables_i32=table,
            context_lens=move(self.context_lens), seq_lens=move(self.seq_lens),
            query_pos=move(self.query_pos), is_query=move(self.is_query),
            slot_mapping=move(self.slot_mapping), token_index=move(self.token_index),
            key_hidden=move(self.key_hidden), scratch={},
            parts=None if self.parts is None else [(m.map_tensors(fn), move(p))
                                                   for m, p in self.parts])


def build_metadata(
    block_tables,
    context_lens: torch.Tensor,
    counts: Sequence[int],
    q_len: int,
    max_seq_len: int,
    block_size: int,
    packed: bool = False,
    key_hidden: torch.Tensor | None = None,
    columns: int = 0,
    seq_lens_host: list[int] | None = None,
    split_decodes: bool = False,
    uniform: bool = False,
) -> ForwardMetadata:
    """The metadata of a forward adding `counts[r]` tokens to row r, right-aligned in `q_len`
    columns; the one builder of both paths (generate's `PagedCache`, the engine's runner).

    block_tables: [R, >= cdiv(max_seq_len, block_size)] int32 block ids of the forward's rows
                  (or a `DeviceBlockTable` whose rows are the forward's)
    context_lens: [R] int64 tokens each row holds before the forward
    split_decodes: a packed forward mixing single-token rows with longer ones gets `parts`
    uniform: a forward of more than one token per row always gets `is_query` and
             `token_index` (a compiled forward then has one graph for them, not two)
    """
    table = getattr(block_tables, "table", block_tables)
    device = table.device
    rows = len(counts)
    num_cols = max(cdiv(max_seq_len, block_size), 1)
    block_tables_i32 = table[:, :num_cols]
    # Standard strides for any row count (a compiled forward guards on them).
    block_tables = block_tables_i32.to(torch.int64, memory_format=torch.contiguous_format)
    if q_len == 1 and list(counts).count(1) == rows:  # decode: a token per row, no host sync
        pos = context_lens
        query_pos = pos.unsqueeze(1)
        is_query = token_index = None
        blk = block_tables.gather(1, (pos // block_size).unsqueeze(1)).squeeze(1)
        slot_mapping = blk * block_size + pos % block_size
        seq_lens = context_lens + 1
    else:
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        bounds = to_device(starts, device)
        counts_t = bounds[1:] - bounds[:-1]
        col = torch.arange(q_len, device=device)
        pad = (q_len - counts_t).unsqueeze(1)
        query_pos = context_lens.unsqueeze(1) + col - pad  # [R, q]
        if not uniform and all(c == q_len for c in counts):
            is_query = token_index = None
            row = torch.arange(rows, device=device).repeat_interleave(q_len)
            pos = query_pos.reshape(-1)
        else:
            is_query = col >= pad
            token_index = is_query.reshape(-1).nonzero().squeeze(1)
            row = token_index // q_len
            pos = query_pos.reshape(-1)[token_index]
        slot_mapping = block_tables[row, pos // block_size] * block_size + pos % block_size
        seq_lens = context_lens + counts_t
    parts = None
    if split_decodes and packed and 1 in counts and max(counts) > 1:
        parts = []
        for decode in (True, False):
            members = [r for r, n in enumerate(counts) if (n == 1) == decode]
            index = to_device(members, device)
            where = [t for r in members for t in range(starts[r], starts[r + 1])]
            part_lens = None if seq_lens_host is None else [seq_lens_host[r] for r in members]
            part = build_metadata(
                table.index_select(0, index), context_lens.index_select(0, index),
                [counts[r] for r in members], max(counts[r] for r in members),
                max(part_lens) if part_lens else max_seq_len, block_size, packed=True,
                seq_lens_host=part_lens, uniform=uniform)
            parts.append((part, to_device(where, device)))
    return ForwardMetadata(
        block_tables=block_tables,
        block_tables_i32=block_tables_i32,
        context_lens=context_lens,
        seq_lens=seq_lens,
        query_pos=query_pos,
        is_query=is_query,
        slot_mapping=slot_mapping,
        token_index=token_index,
        max_seq_len=max_seq_len,
        block_size=block_size,
        num_new=sum(counts),
        packed=packed,
        key_hidden=key_hidden,
        columns=columns,
        seq_lens_host=seq_lens_host,
        query_lens_host=None if seq_lens_host is None else list(counts),
        parts=parts,
    )


def decode_metadata(table: DeviceBlockTable, rows: list[int], context: list[int],
                    context_t: torch.Tensor | None, block_size: int,
                    host_lengths: bool = True) -> list[ForwardMetadata]:
    """The packed metadata of a forward adding one token to each of `rows`, per KV group,
    from a table kept with `host_mirror`: each row's slot is read from the host lists (a
    dozen tensor ops fewer than `build_metadata`), slots and lengths reach the device in
    one copy.

    context: the tokens each row holds (its new token's position); context_t: the same on
    the device, if the caller has it. host_lengths: keep `seq_lens_host`.
    """
    n, per_group = len(rows), table.num_rows
    lens = [c + 1 for c in context]
    longest = max(lens)
    cols = cdiv(longest, block_size)
    metas = []
    for g in range(table.num_groups):
        host = table.host[g * per_group:] if g else table.host
        slots = [host[r][c // block_size] * block_size + c % block_size
                 for r, c in zip(rows, context)]
        packed = to_device(rows + slots + lens if g == 0 else rows + slots, table.device)
        if g == 0:
            seq_lens = packed[2 * n:]
            if context_t is None or context_t.device != seq_lens.device:
                context_t = seq_lens - 1
        tables = table.group(g).index_select(0, packed[:n])[:, :cols]
        metas.append(ForwardMetadata(
            block_tables=tables.long(), block_tables_i32=tables, context_lens=context_t,
            seq_lens=seq_lens, query_pos=context_t.unsqueeze(1), is_query=None,
            slot_mapping=packed[n:2 * n], token_index=None, max_seq_len=longest,
            block_size=block_size, num_new=n, packed=True,
            seq_lens_host=lens if host_lengths else None))
    return metas
