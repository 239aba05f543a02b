"""Device-side helpers shared by the kernels of both arches (constants and tiny CuTe DSL functions)."""

from __future__ import annotations

import math

import cutlass
from cutlass import Float32

LOG2E = math.log2(math.e)  # softmax runs in the log2 domain: exp(x) = exp2(x * LOG2E)
LN2 = math.log(2.0)  # and reports natural-log lse: ln(x) = log2(x) * LN2
NEG_INF = float("-inf")


def fsel(cond, a, b):
    """Float32 select ``cond ? a : b``, branch-free."""
    return Float32(cutlass.select_(cond, Float32(a), Float32(b)))


def reduce_over_rows(x, combine):
    """Combine ``x`` over the 8 lanes of a warp that hold one accumulator column (lane bits 2..4):
    the rows of an mma/wgmma accumulator fragment. ``combine``: e.g. ``cute.arch.fmax`` or ``+``."""
    import cutlass.cute as cute

    for offset in (4, 8, 16):
        x = combine(x, cute.arch.shuffle_sync_bfly(x, offset=offset))
    return x
