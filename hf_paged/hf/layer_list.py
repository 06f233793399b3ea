"""The engine's layer-list slices: Transformers' decoder forwards loop over
`self.layers[: self.config.num_hidden_layers]`, and slicing an `nn.ModuleList` builds a new
module each time (about 10 µs in an eager forward, most of a small model's decode step's
module-building). Inside an engine forward on this thread, such a slice comes from a cache
while the list's members are the same; everywhere else slicing is torch's own.

`use_cached_slices(model)` gives each plain `nn.ModuleList` of the model the subclass
`SlicedOnceModuleList` (isinstance checks, state dicts and deepcopy are unchanged; the cache
lives outside the module, so nothing about it is saved or copied); `cached_slices()` turns
the cache on for the calling thread around a forward. A traced forward slices as torch does.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch
from torch import nn


class _Thread(threading.local):
    on = False  # inside `cached_slices()` on this thread


_THREAD = _Thread()

# list -> (the slice, the list's members when it was taken, the sliced ModuleList)
_SLICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class SlicedOnceModuleList(nn.ModuleList):
    """An `nn.ModuleList` whose slices, taken inside `cached_slices()` on its thread, are
    built once and reused while the list holds the same modules."""

    def __getitem__(self, idx):
        if not (_THREAD.on and isinstance(idx, slice)) or torch.compiler.is_compiling():
            return super().__getitem__(idx)
        members = tuple(self._modules.values())
        cached = _SLICES.get(self)
        # (tuples compare their modules by identity: a list edited since is sliced anew)
        if cached is not None and cached[0] == idx and cached[1] == members:
            return cached[2]
        part = super().__getitem__(idx)
        _SLICES[self] = (idx, members, part)
        return part


def use_cached_slices(model: nn.Module) -> None:
    """Gives the model's plain `nn.ModuleList`s the class `SlicedOnceModuleList` (subclasses
    of `nn.ModuleList` are left alone)."""
    for module in model.modules():
        if type(module) is nn.ModuleList:
            module.__class__ = SlicedOnceModuleList


@contextlib.contextmanager
def cached_slices():
    """Inside, slices of `SlicedOnceModuleList`s taken on this thread come from the cache."""
    outer, _THREAD.on = _THREAD.on, True
    try:
        yield
    finally:
        _THREAD.on = outer
