"""The logits of one engine step, gathered from its forwards for sampling."""

from __future__ import annotations

import torch


class StepLogits:
    """The logits of a step's sampling sequences, as its forwards produce them."""

    def __init__(self):
        self._items: list[list] = []  # per forward, its scheduled items
        self._parts: list[torch.Tensor] = []  # per forward, [its sampling items, V]

    def add(self, items: list, rows: torch.Tensor) -> None:
        """rows [S, V]: the logits of the items of `items` that sample, in order."""
        self._items.append(items)
        self._parts.append(rows)

    def rows(self, sampling: list, index: list[int],
             offsets: list[int] | None = None) -> torch.Tensor:
        """[R, V]: row r holds the logits of `sampling[index[r]]` (the step's sampling
        items, in plan order); offsets: row r reads that item's position `offsets[r]` (a
        speculating item has 1 + len(draft) of them, its drafts' first)."""
        stacked = self._parts[0] if len(self._parts) == 1 else torch.cat(self._parts)
        if (offsets is None and len(self._parts) == 1
                and len(sampling) == len(index) == stacked.shape[0]):
            # One forward, nobody failed or forked: its sampling rows are `sampling`, in order.
            return stacked
        where, n = {}, 0
        for items in self._items:
            for item in items:
                if item.sample:
                    where[id(item)] = n
                    n += 1 + len(item.draft)
        gather = [where[id(sampling[i])] for i in index]
        if offsets is not None:
            gather = [g + o for g, o in zip(gather, offsets)]
        return stacked[torch.tensor(gather, device=stacked.device)]
