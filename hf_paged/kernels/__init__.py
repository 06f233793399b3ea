"""Paged attention kernels. `reference` is the pure-PyTorch path every backend is checked against."""

from . import reference

__all__ = ["reference"]
