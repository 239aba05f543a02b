"""Online-softmax and log-sum-exp building blocks shared by every kernel that normalizes attention:
the decode kernels (Hopper, Blackwell), the BF16 window + merge kernel and the split-KV combine.

Conventions: scores live in the log2 domain (``sm_scale * log2(e)`` folded in), so a running max
``m`` and sum ``l = sum exp2(s - m)`` give the natural-log ``lse = (m + log2 l) * ln 2``; a partial
result is carried as ``(o normalized, lse)`` with ``lse = -inf`` (and ``o`` = anything) when it saw
no token. Every helper is branch-free and maps -inf inputs to the documented empty result.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32

from .device import LN2, LOG2E, NEG_INF, fsel

__all__ = ["finite_reference", "fast_exp2", "online_update", "rescale_factor", "normalize", "lse_weight", "merged_lse"]


def finite_reference(m):
    """``m``, or 0 where ``m`` is -inf (no valid score): exp2(x - reference) is then 0, never NaN."""
    return fsel(m == Float32(NEG_INF), Float32(0.0), m)


def fast_exp2(x):
    """``2^x`` by the fast-math path (``ex2.approx``), Blackwell's and the merges' exp2."""
    return cute.math.exp2(x, fastmath=True)


def online_update(m_run, tile_max, exp2, may_be_empty: bool = True):
    """One online-softmax step of a running max, as both decode kernels take it: ``(m_new, alpha, reference)``,
    the new max, the factor ``exp2(m_run - reference)`` that rescales what was summed against ``m_run``, and the
    reference the tile's P is taken against: ``m_new``, or 0 where that is -inf when ``may_be_empty`` (a column
    that has seen no token yet; else the caller guarantees a finite max). ``exp2``: the arch's (Hopper's
    ``cute.arch.exp2``, Blackwell's :func:`fast_exp2`)."""
    m_new = cute.arch.fmax(m_run, tile_max)
    reference = finite_reference(m_new) if may_be_empty else m_new
    return m_new, exp2(m_run - reference), reference


def rescale_factor(m_old, m_new, fastmath: bool = True):
    """``exp2(m_old - m_new)``: what a running sum (and output) kept relative to ``m_old`` is
    multiplied by when the running max moves to ``m_new`` (0 when ``m_old`` was -inf)."""
    return cute.math.exp2(m_old - finite_reference(m_new), fastmath=fastmath)


def normalize(l_sum, m_log2, fastmath: bool = True):
    """``(1/l, lse)`` of a softmax with running max ``m_log2`` (log2 domain) and sum ``l_sum``:
    ``(0, -inf)`` when nothing was summed."""
    has = l_sum > Float32(0.0)
    inv_l = fsel(has, cute.arch.rcp_approx(l_sum), Float32(0.0))
    lse = fsel(has, (m_log2 + cute.math.log2(l_sum, fastmath=fastmath)) * LN2, Float32(NEG_INF))
    return inv_l, lse


def lse_weight(lse, reference):
    """``exp(lse - reference)`` (natural log): the weight of a partial result in a merge."""
    return cute.math.exp2((lse - reference) * LOG2E, fastmath=True)


def merged_lse(reference, total):
    """The lse of a merge whose weights relative to ``reference`` sum to ``total`` (-inf if 0)."""
    return fsel(total > Float32(0.0), reference + cute.math.log2(total, fastmath=True) * LN2, Float32(NEG_INF))
