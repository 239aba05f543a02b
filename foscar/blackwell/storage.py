"""Named offsets of the sm_100a decode kernel's small shared-memory areas.

The per-query-row areas hold ``N_MAX`` rows (the kernel pads the query columns to N = 8 or 16);
every offset the kernel and the fold hooks (``foscar.blackwell.folds``) use is one of these
helpers, so the limits they assume (``N <= N_MAX``, at most ``MAX_STEP_GROUPS`` channel-wise K
groups per 128-token step, at most ``N_MAX`` token-wise V channel blocks) are stated here and
checked by ``BlackwellConfig``.

==========  ===========================================  ========================================
area        per                                          holds
==========  ===========================================  ========================================
sQinfo      CTA                                          S unscale[r] | Q scale[r] | Qsum[r, j]
sKinfo      operand stage (channel-wise K)               S unscale[t] | C[t, r] = sum_d z[d,t] q[r,d]
sAlpha      P buffer                                     alpha[r] | P unscale[j]
sPsum       P buffer (channel-wise V)                    Psum[warp, r]
sRed        step parity (softmax)                        per-warp partials: row max | V scale max[j]
sFinal      CTA (softmax -> output)                      l[r] | m[r] | token-wise V offset term[j, r]
==========  ===========================================  ========================================
"""

from __future__ import annotations

from typing import Any, NamedTuple

N_MAX = 16  # query columns of the per-row areas
WARPS = 4  # warps of a warpgroup: one partial per warp in sRed / sPsum
MAX_STEP_GROUPS = 4  # channel-wise K token groups per 128-token step (groups >= 32 tokens)

QINFO_FIXED = 2 * N_MAX  # S unscale and Q scale rows before the Qsum block
KINFO = 80  # floats per operand stage of sKinfo: MAX_STEP_GROUPS unscales + MAX_STEP_GROUPS x N_MAX C terms, padded
ALPHA_WORDS = 2 * N_MAX  # floats per P buffer of sAlpha
PSUM_WORDS = WARPS * N_MAX  # floats per P buffer of sPsum
RED_BLOCK = WARPS * N_MAX  # floats of one sRed block (a (row, warp) table)
FINAL_FIXED = 2 * N_MAX  # l and m rows before the V offset terms in sFinal
PREP_RED_WORDS = WARPS * N_MAX  # the preparation warpgroup's reduction scratch


class Smem(NamedTuple):
    """The kernel's shared-memory tensors by name (what every role and fold hook reads). Immutable:
    the DSL rebinds a tensor written inside a runtime ``if``/``for`` to the region's result, which
    must not leak into the caller's object."""

    sK: Any  # K step [128 tokens x D] operand bytes (MMA, MMA_M, MMA_K, OP_STAGES)
    sV: Any  # V^T step [128 channels x 128 tokens] operand bytes (..., OP_STAGES * MT)
    sQ: Any  # Q'^T in FP8 pieces (MMA, MMA_N, MMA_K, 1 | OP_STAGES)
    sP: Any  # P'^T in FP8 pieces (MMA, MMA_N, MMA_K, P_BUFS * P_STAGES)
    sQinfo: Any
    sKinfo: Any
    sZ: Any  # z[d, t] of the step (channel-wise K)
    sAlpha: Any
    sPsum: Any
    sRed: Any
    sRedP: Any
    sCorr: Any  # token-wise V: per-thread offset terms [j * N + r, thread]
    sFinal: Any
    sQf: Any  # q [N, D] fp32 (channel-wise K)
    sVp: Any  # channel-wise V: the step's (scale, offset) pairs [group, channel] per P buffer


def qinfo_words(s_blocks: int) -> int:
    return QINFO_FIXED + N_MAX * s_blocks


def red_words(p_stages: int) -> int:
    """One sRed half: the row maxima, then one block per P stage (token-wise V scale maxima)."""
    return RED_BLOCK * (1 + p_stages)


def final_words(p_stages: int) -> int:
    return FINAL_FIXED + N_MAX * p_stages


# sQinfo -----------------------------------------------------------------------------------------
def s_unscale(r):
    """S unscale of query row r: log2(e) * sm_scale / Q scale."""
    return r


def q_scale(r):
    """Power-of-two scale that put q row r into [128, 256)."""
    return N_MAX + r


def qsum(r, j, s_blocks: int):
    """Qsum of row r over channel block j (token-wise K), times log2(e) * sm_scale."""
    return QINFO_FIXED + r * s_blocks + j


def qsum_thread(x):
    """Qsum slot ``x = r * s_blocks + j`` (one per preparation thread)."""
    return QINFO_FIXED + x


# sKinfo (channel-wise K, per operand stage) ----------------------------------------------------
def kinfo_stage(so):
    """First float of operand stage so (computed once where a stage's entries are written)."""
    return so * KINFO


def k_unscale(stage, tk):
    """S unscale 2^e_tk / a of token group tk; ``stage`` = kinfo_stage(so)."""
    return stage + tk


def k_offset_term(stage, tk, r):
    """C[tk, r] = sum_d z[d, tk] q[r, d], times log2(e) * sm_scale; ``stage`` = kinfo_stage(so)."""
    return stage + MAX_STEP_GROUPS + tk * N_MAX + r


# sAlpha, sPsum (per P buffer) ------------------------------------------------------------------
def alpha(sp, r):
    return sp * ALPHA_WORDS + r


def p_unscale(sp, j):
    """1/a over the power-of-two scale of P stage j (exact)."""
    return sp * ALPHA_WORDS + N_MAX + j


def psum(sp, w, r):
    """Warp w's partial sum of P over its tokens, row r."""
    return sp * PSUM_WORDS + w * N_MAX + r


# sRed ------------------------------------------------------------------------------------------
def red_row(red, r):
    """First of the WARPS per-warp partials of row r (add the warp)."""
    return red + WARPS * r


def red_block(red, j):
    """Block j (P stage j) of a sRed half: WARPS partials per row."""
    return red + RED_BLOCK * (1 + j)


# sFinal ----------------------------------------------------------------------------------------
def final_l(r):
    return r


def final_m(r):
    return N_MAX + r


def final_term(j, r):
    """Token-wise V offset term sum_l z[l, j] P[l] of row r."""
    return FINAL_FIXED + j * N_MAX + r
