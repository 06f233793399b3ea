"""Per-forward paging metadata, built once per model forward and shared by all layers.

The device copy of the block tables is kept in step with `BlockTables` incrementally:
new entries are scattered in, beam reorders gather rows; nothing is rebuilt from
Python lists on a decode step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from ..errors import HFPagedError
from ..kernels.reference import key_mask


def to_device(values, device: torch.device) -> torch.Tensor:
    """int64 tensor of host `values` on `device`, without waiting for queued GPU work.

    (A pageable host->device copy is staged before the call returns, so it needs no sync.)
    """
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


class DeviceBlockTable:
    """Device mirror of `BlockTables`: block ids [R, cols] int32 and real lengths [R] int64."""

    # The table is written in place; it is made outside inference mode so that a cache
    # started under torch.inference_mode() can continue under no_grad, and back.
    def __init__(self, num_rows: int, num_cols: int, device: torch.device):
        self.device = device
        with torch.inference_mode(False):
            self.table = torch.zeros(num_rows, max(num_cols, 1), dtype=torch.int32, device=device)
        self.lengths = torch.zeros(num_rows, dtype=torch.int64, device=device)

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
        self.ensure_cols(max(e[1] for e in entries) + 1)
        rows, cols, blocks = to_device(entries, self.device).T
        self.table[rows, cols] = blocks.to(torch.int32)

    def fork(self, src_rows: torch.Tensor) -> None:
        """Row i becomes old row src_rows[i] (device-side mirror of `BlockTables.fork_rows`)."""
        src_rows = src_rows.to(self.device)
        with torch.inference_mode(False):
            self.table = self.table.index_select(0, src_rows.clone())
        self.lengths = self.lengths.index_select(0, src_rows)


@dataclass
class ForwardMetadata:
    """Where one forward's new tokens go and what each query may read.

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
    key_hidden:   [R, T] bool, True on stored slots no query may see (see masking.py);
                  None when there are none (only the reference backend reads it)
    columns:      columns generate has seen after this forward; slot t of row r holds
                  column t + columns - seq_lens[r]
    seq_lens_host: seq_lens as a host list, when the builder knows it (lets the reference
                  backend group decode rows of similar lengths)
    parts:        for a packed forward mixing decodes and prompt chunks, attention runs per
                  part: (metadata of some rows, [n] int64 positions of their tokens in the
                  packed input), so decode rows are not padded to the longest chunk; None:
                  one part, this metadata
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
    parts: list | None = None
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def num_keys(self) -> int:
        return self.block_tables.shape[1] * self.block_size

    def to(self, device: torch.device) -> "ForwardMetadata":
        """This metadata on `device` (for the layers of a pool shard there): each tensor
        copied once, host fields shared, the per-forward mask cache fresh."""
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
            key_hidden=move(self.key_hidden), _masks={},
            parts=None if self.parts is None else [(m.map_tensors(fn), move(p))
                                                   for m, p in self.parts])

    def length_groups(self) -> list[tuple[torch.Tensor, int]] | None:
        """Decode rows bucketed by length, as ([n] row indices, block columns they need),
        when that saves at least a fifth of the padded keys; None otherwise.

        A gather-based attention pads every row to the longest; buckets whose lengths are
        within 25% of each other keep the padding small. Built once per forward."""
        if "groups" in self._masks:
            return self._masks["groups"]
        groups = None
        lens = self.seq_lens_host
        if lens is not None and len(lens) >= 8:
            buckets: dict[int, list[int]] = {}
            for row, n in enumerate(lens):
                blocks = max(-(-n // self.block_size), 1)
                buckets.setdefault(int(math.log(blocks, 1.25)), []).append(row)
            padded = len(lens) * self.block_tables.shape[1]
            cols = {k: max(-(-max(lens[r] for r in rows) // self.block_size), 1)
                    for k, rows in buckets.items()}
            if len(buckets) > 1 and sum(len(r) * cols[k] for k, r in buckets.items()) < 0.8 * padded:
                device = self.block_tables.device
                groups = [(torch.tensor(rows, device=device), cols[k])
                          for k, rows in sorted(buckets.items())]
        self._masks["groups"] = groups
        return groups

    @property
    def needs_reference(self) -> bool:
        """Hidden slots are read by the reference backend only."""
        return self.key_hidden is not None

    def attention_mask(self, sliding_window: int | None,
                       alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
        """Mask for the reference path, built once per forward and shared by all layers.

        [R, 1, q, T] bool, or with ALiBi slopes [H] a float bias [R, H, q, T]
        (slope * key position where visible, -inf elsewhere).
        """
        key = (sliding_window, alibi_slopes is not None)
        mask = self._masks.get(key)
        if mask is None:
            mask = key_mask(self.query_pos, self.is_query, self.num_keys, sliding_window,
                            self.key_hidden)
            if alibi_slopes is not None:
                mask = self._alibi_bias(alibi_slopes).masked_fill(~mask, float("-inf"))
            self._masks[key] = mask
        return mask

    def _alibi_bias(self, slopes: torch.Tensor) -> torch.Tensor:
        """slope * key position [R or 1, H, 1, T]. Positions count visible tokens, as
        Falcon's alibi counts real tokens of the mask (hidden slots are skipped)."""
        if self.key_hidden is None:
            t = torch.arange(self.num_keys, device=slopes.device, dtype=slopes.dtype)
            return slopes.view(1, -1, 1, 1) * t
        t = ((~self.key_hidden).cumsum(-1) - 1).to(slopes.dtype)  # [R, T]
        return slopes.view(1, -1, 1, 1) * t[:, None, None, :]

    def caller_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """A caller's 4D mask over columns, [R or 1, 1 or H, q, columns] (bool, True = attend,
        or an additive float bias), moved onto slots: [R, 1 or H, q, T], unstored slots
        masked. Raises if the mask lets a query see a column that has no slot."""
        cached = self._masks.get("caller")
        if cached is not None and cached[0] is mask:  # the same mask reaches every layer
            return cached[1]
        given = mask
        rows, q_len = self.query_pos.shape
        if (mask.dim() != 4 or mask.shape[0] not in (1, rows) or mask.shape[2] != q_len
                or mask.shape[3] != self.columns):
            raise ValueError(
                f"A 4D attention mask on a PagedCache forward must have shape [batch, 1 or "
                f"heads, new columns, all columns] = [{rows}, 1, {q_len}, {self.columns}]; got "
                f"{tuple(mask.shape)}."
            )
        mask = mask.expand(rows, -1, -1, -1)
        visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        skip = self.columns - self.seq_lens  # [R] leading columns without a slot
        unstored = torch.arange(self.columns, device=mask.device) < skip.unsqueeze(1)
        if (visible & unstored[:, None, None, :]).any():
            raise HFPagedError(
                "This 4D attention mask lets queries see columns that were left padding when "
                "they were cached; the PagedCache did not store them. Mask those columns, or "
                "use a cache that was filled without padding."
            )
        slots = torch.arange(self.num_keys, device=mask.device)
        cols = (slots.unsqueeze(0) + skip.unsqueeze(1)).clamp(max=self.columns - 1)  # [R, T]
        index = cols[:, None, None, :].expand(rows, mask.shape[1], q_len, self.num_keys)
        out = mask.gather(-1, index)
        stored = (slots.unsqueeze(0) < self.seq_lens.unsqueeze(1))[:, None, None, :]
        out = out & stored if out.dtype == torch.bool else out.masked_fill(~stored, float("-inf"))
        self._masks["caller"] = (given, out)
        return out


def build_metadata(
    table: DeviceBlockTable,
    context_lens: torch.Tensor,
    counts: Sequence[int],
    q_len: int,
    max_seq_len: int,
    block_size: int,
    packed: bool = False,
    key_hidden: torch.Tensor | None = None,
    columns: int = 0,
    seq_lens_host: list[int] | None = None,
) -> ForwardMetadata:
    """Metadata for a forward adding `counts[r]` tokens, right-aligned in `q_len` columns."""
    device = table.device
    rows = len(counts)
    num_cols = max(-(-max_seq_len // block_size), 1)
    block_tables_i32 = table.table[:, :num_cols]
    block_tables = block_tables_i32.long()
    if q_len == 1 and all(c == 1 for c in counts):  # decode: one real token per row, no host sync
        pos = context_lens
        query_pos = pos.unsqueeze(1)
        is_query = token_index = None
        blk = block_tables.gather(1, (pos // block_size).unsqueeze(1)).squeeze(1)
        slot_mapping = blk * block_size + pos % block_size
        seq_lens = context_lens + 1
    else:
        counts_t = to_device(counts, device)
        col = torch.arange(q_len, device=device)
        pad = (q_len - counts_t).unsqueeze(1)
        query_pos = context_lens.unsqueeze(1) + col - pad  # [R, q]
        if all(c == q_len for c in counts):
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
    )
