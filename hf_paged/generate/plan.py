"""How a forward's 2D padding mask maps onto the slots a `PagedCache` stores.

Column `c` of row `r` (Transformers' padded columns) lives in slot `c - skip[r]`, where
`skip[r]` counts the row's leading padding: columns before its first real token take no
slot. Every later column takes one, real or not. A column the mask hides after the row's
first real token (right padding, a padded turn, a pad token an assistant emitted) is a
*hidden slot*: stored, never attended. Causality and sliding windows, which Transformers
counts in columns, therefore hold on slots unchanged, and `crop` drops exactly the slots of
the columns it removes. A later mask may hide a cached slot or show a hidden one again;
only a skipped column cannot come back (it was never stored).

Since every row holds its last `lengths[r]` columns, `skip[r] = seen - lengths[r]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import HFPagedError
from ..kv.metadata import to_device

# The forward keyword that gives a packed forward's StepPlan to the patched model forward
# (generate's packed prefill passes it; see generate/patches.py).
PLAN_KWARG = "paged_plan"


@dataclass
class StepPlan:
    """What one forward adds to a cache; computing it changes no state.

    counts: slots each row gains (its new columns from its first real token on)
    width:  input columns the forward covers (what generate counts as sequence length)
    packed: the input holds only real tokens, rows back to back ([1, N])
    hidden: (row, slot) of new slots the mask hides
    hide:   (row, slot) of cached slots the mask hides from now on
    show:   (row, slot) of hidden cached slots the mask shows again
    """

    counts: list[int]
    width: int
    packed: bool = False
    hidden: list[tuple[int, int]] = field(default_factory=list)
    hide: list[tuple[int, int]] = field(default_factory=list)
    show: list[tuple[int, int]] = field(default_factory=list)


class HiddenSlots:
    """Per row, the stored slots no query may see. Host side; empty in the common case."""

    def __init__(self, rows: int = 0):
        self.rows: list[set[int]] = [set() for _ in range(rows)]
        self.count = 0

    def _recount(self) -> None:
        self.count = sum(len(s) for s in self.rows)

    def resize(self, rows: int) -> None:
        self.rows = [set() for _ in range(rows)]
        self.count = 0

    def fork(self, src_rows: list[int]) -> None:
        """Row i takes old row src_rows[i]'s hidden slots (beam reorder)."""
        if self.count:
            self.rows = [set(self.rows[r]) for r in src_rows]
            self._recount()
        else:
            self.rows = [set() for _ in src_rows]

    def truncate(self, lengths: list[int]) -> None:
        if self.count:
            self.rows = [{s for s in slots if s < n} for slots, n in zip(self.rows, lengths)]
            self._recount()

    def apply(self, plan: StepPlan) -> None:
        for r, s in plan.hidden + plan.hide:
            self.rows[r].add(s)
        for r, s in plan.show:
            self.rows[r].discard(s)
        if plan.hidden or plan.hide or plan.show:
            self._recount()

    def slot_mask(self, num_slots: int, device: torch.device) -> torch.Tensor | None:
        """[R, num_slots] bool, True on hidden slots; None when there are none."""
        if not self.count:
            return None
        pairs = [(r, s) for r, slots in enumerate(self.rows) for s in slots if s < num_slots]
        mask = torch.zeros(len(self.rows), num_slots, dtype=torch.bool, device=device)
        if pairs:
            rows, slots = to_device(pairs, device).T
            mask[rows, slots] = True
        return mask

    def column_mask(self, skip: list[int], seen: int, device: torch.device) -> torch.Tensor:
        """[R, seen] bool, True on cached columns whose slot is hidden."""
        pairs = [(r, s + skip[r]) for r, slots in enumerate(self.rows) for s in slots]
        mask = torch.zeros(len(self.rows), seen, dtype=torch.bool, device=device)
        if pairs:
            rows, cols = to_device(pairs, device).T
            mask[rows, cols] = True
        return mask


def inner_padding(mask: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor: whether a 2D attention mask [R, L] has a zero after a real token."""
    mask = mask.bool()
    return (mask.cummax(1).values & ~mask).any()


def check_mask_shape(mask: torch.Tensor, rows: int, seen: int, q_len: int) -> None:
    if mask.dim() != 2 or mask.shape[0] != rows or mask.shape[1] != seen + q_len:
        raise ValueError(
            f"PagedCache expects a 2D attention mask of shape [batch, cached + new columns] = "
            f"[{rows}, {seen + q_len}] ({seen} cached, {q_len} new); got {tuple(mask.shape)}."
        )


def plan_unmasked(lengths: list[int], seen: int, q_len: int, hidden: HiddenSlots) -> StepPlan:
    """A forward without a padding mask: every column, cached ones included, is real."""
    if seen and min(lengths) < seen:
        skipped = [r for r, n in enumerate(lengths) if n < seen]
        raise HFPagedError(
            f"A forward without an attention mask (or with one of all ones, which Transformers "
            f"drops) treats every cached column as a real token, but rows {skipped[:8]} of "
            "this PagedCache began with padding, which it did not store. Pass the attention "
            "mask (2D, [batch, cached + new columns]) with those columns at 0."
        )
    show = [(r, s) for r, slots in enumerate(hidden.rows) for s in slots] if hidden.count else []
    return StepPlan([q_len] * len(lengths), q_len, show=show)


def plan_from_mask(mask: torch.Tensor, lengths: list[int], seen: int,
                   hidden: HiddenSlots) -> StepPlan:
    """The plan of a forward whose 2D mask [R, seen + q] (1 = real token) is given.

    One host sync; a second only when the mask hides new slots or changes cached ones.
    """
    rows, width = mask.shape
    q_len = width - seen
    real = mask.bool()
    device = real.device
    lengths_t = to_device(lengths, device)
    new = real[:, seen:]
    stored = new.cummax(1).values | (lengths_t > 0).unsqueeze(1)  # [R, q] columns that get slots
    new_hidden = stored & ~new
    flags = [stored.sum(1), new_hidden.any().view(1)]
    changed = None
    if seen:
        skip = [seen - n for n in lengths]
        cols = torch.arange(seen, device=device)
        expected = cols >= (seen - lengths_t).unsqueeze(1)  # [R, seen] stored columns
        if hidden.count:
            expected &= ~hidden.column_mask(skip, seen, device)
        changed = real[:, :seen] != expected
        flags.append(changed.any().view(1))
    values = torch.cat(flags).tolist()  # the one host sync of this step
    counts = values[:rows]
    plan = StepPlan(counts, q_len)
    if values[rows]:
        for r, c in new_hidden.nonzero().tolist():
            plan.hidden.append((r, lengths[r] + c - (q_len - counts[r])))
    if changed is not None and values[rows + 1]:
        for r, c in changed.nonzero().tolist():
            slot = c - skip[r]
            if slot < 0:
                raise HFPagedError(
                    f"The attention mask marks cached column {c} of row {r} as a real token, but "
                    "that column was padding before the row's first real token when it was "
                    "cached, and the PagedCache did not store it. Pass the mask the cache was "
                    "filled with for cached columns, or start from a new cache."
                )
            (plan.show if slot in hidden.rows[r] else plan.hide).append((r, slot))
    return plan


def plan_forward(rows: int, q_len: int, mask, packed: StepPlan | None, *, seen: int,
                 hidden: HiddenSlots, lengths: list[int] | None, expected: tuple | None,
                 by_hand: bool, generate_columns: int | None) -> StepPlan:
    """What a forward of input [rows, q_len] adds to a PagedCache, from its mask or packing;
    changes nothing.

    mask: the forward's own (2D, 4D or None); packed: a packed forward's plan; seen: columns
    cached; lengths: real tokens per row (None before the first forward); expected: (mask,)
    given to `expect_forward` (it replaces the forward's own); by_hand: no model forward,
    every new column is stored; generate_columns: see `PagedCache.begin_generate`.
    """
    if packed is not None:
        if sum(packed.counts) != q_len or rows != 1 or seen:
            raise ValueError(
                f"PagedCache: a packed forward of {sum(packed.counts)} tokens was planned "
                f"for an empty cache, but the model ran on input of shape [{rows}, {q_len}] "
                f"after {seen} cached columns."
            )
        return packed
    if lengths is not None and rows != len(lengths):
        raise ValueError(
            f"PagedCache holds {len(lengths)} sequence(s) but the forward has {rows} "
            "rows; call reset() before reusing the cache for another batch."
        )
    if expected is not None:
        mask = expected[0]
    elif by_hand or (mask is not None and mask.dim() == 4):
        return StepPlan([q_len] * rows, q_len)  # a caller's mask: every column stored
    lengths = lengths if lengths is not None else [0] * rows
    if mask is None:
        return plan_unmasked(lengths, seen, q_len, hidden)
    check_mask_shape(mask, rows, seen, q_len)
    if q_len == 1 and generate_columns is not None and seen >= generate_columns:
        return StepPlan([1] * rows, 1)  # a column generate appended: real in every row
    return plan_from_mask(mask, lengths, seen, hidden)
