"""Float32 linear layers on CPUs through oneDNN, for the engine's forwards.

Torch runs a float32 `nn.Linear` on a CPU as MKL's sgemm, which copies (packs) the weight
anew on every call. At the few rows of a decode step that copy is most of the work: on the
2-core AMD EPYC the benchmarks run on, a 1024 x 1024 weight takes 0.30 ms at 8 rows through
MKL and 0.18 ms through oneDNN's matmul on the same, unpacked weight; a 32,000 x 1,024 LM
head at 16 rows 27.5 ms and 10.8 ms; at 2,048 rows oneDNN is still 2% to 20% faster. Under
about half a million weight elements MKL's call is the cheaper one (oneDNN's fixed cost
per call is some 20 µs), so only larger layers switch (`worth_it`).

The two libraries sum in different orders: a row's values differ from MKL's by float32
rounding (about 1e-6 relative), as MKL's own differ between a call of 1 row and one of 16.
"""

from __future__ import annotations

import functools
import logging

import torch

from .library import define, tracing

logger = logging.getLogger("hf_paged")

#: Weights of fewer elements stay on MKL (see the module's docstring).
MIN_WEIGHT_ELEMENTS = 1 << 19


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# A traced forward (torch.compile) records this op; Inductor calls it as an external kernel
# (its own lowering of oneDNN's op wants a frozen weight).
_op = define("onednn_linear", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
             _shape)(_onednn)


@functools.cache
def available() -> bool:
    """Whether this torch build runs oneDNN's float32 matmul (x86 and Arm builds do)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        _onednn(torch.ones(2, 4), torch.ones(3, 4), None)
    except (AttributeError, RuntimeError, NotImplementedError) as err:
        logger.info("hf-paged: oneDNN's matmul is not available (%s); linear layers stay "
                    "on torch's own", err)
        return False
    return True


def worth_it(weight: torch.Tensor) -> bool:
    """Whether a layer of this weight runs faster through oneDNN: a float32 CPU weight of
    at least `MIN_WEIGHT_ELEMENTS` elements (and a build with oneDNN)."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.numel() >= MIN_WEIGHT_ELEMENTS and available())


def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear` may run this call: float32 on the CPU (not a layer moved or cast
    since), a contiguous weight, a contiguous [N] bias or none (oneDNN's op reads any bias
    as N contiguous values) and matching shapes (others get the caller's own error)."""
    return (x.dtype == weight.dtype == torch.float32 and x.is_cpu and weight.is_cpu
            and weight.is_contiguous() and x.shape[-1] == weight.shape[1]
            and (bias is None or (bias.shape == weight.shape[:1] and bias.is_contiguous())))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through oneDNN, for a call that `fits`: x [..., K],
    weight [N, K], bias [N] or None -> [..., N]."""
    return _op(x, weight, bias) if tracing() else _onednn(x, weight, bias)
