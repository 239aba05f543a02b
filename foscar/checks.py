"""Argument checks shared by the host API (cache, batch, decode, quantize, references, integrations), so that one
kind of argument is accepted alike everywhere."""

from __future__ import annotations

import math
import numbers

__all__ = ["LOG2E", "MAX_SM_SCALE", "is_int", "checked_sm_scale"]

LOG2E = math.log2(math.e)  # the kernels' softmax runs in the log2 domain: exp(x) = exp2(x * LOG2E)
# The kernels' scores sm_scale * log2(e) * q.k are float32 (exp2 softmax). Far above any model's scale (1/sqrt(head_dim),
# at most ~1), this bound keeps every score of float16-range q and k finite (head_dim 256: |q.k| < 1.1e12)
MAX_SM_SCALE = 2.0**16
INDEX_LIMIT = 2**31  # elements a kernel indexes with 32-bit offsets (pools, outputs, partials)


def is_int(value) -> bool:
    """Whether ``value`` is an integer argument: a Python or numpy int (``numbers.Integral``), but not a bool (True
    would pass as 1 and fail later, far from its cause)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def checked_sm_scale(sm_scale, default: float | None = None) -> float:
    """``sm_scale`` as a float, or ``default`` where it is None and the caller has one; else a ValueError. It must
    be positive and at most :data:`MAX_SM_SCALE`, so that the kernels' float32 scores are finite."""
    if sm_scale is None and default is not None:
        return default
    # comparisons, not float(): exact for any int or Fraction, False for nan
    if not isinstance(sm_scale, numbers.Real) or isinstance(sm_scale, bool) or not 0 < sm_scale <= MAX_SM_SCALE:
        raise ValueError(f"sm_scale must be {'None or ' if default is not None else ''}a positive finite float at "
                         f"most {MAX_SM_SCALE:.4g} (the kernels' scores sm_scale * log2(e) * q.k are float32), got "
                         f"{sm_scale!r}")
    return float(sm_scale)
