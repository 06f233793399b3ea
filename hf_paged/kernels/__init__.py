"""Paged attention kernels. `reference` is the pure-PyTorch path every backend is checked against."""

from ..kernels import reference

__all__ = ["reference"]
