"""Device building blocks of the sm_100a decode kernel and its fold hooks: the warpgroup geometry
(its named barriers: ``foscar.barriers``), FP8 hi/lo operands with power-of-two normalisation, and TMEM row loads."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float8E4M3FN, Float32

from ..layouts.fragment import TILE_TOKENS

STEP = 2 * TILE_TOKENS  # tokens per MMA step (M = 128)
WG = 128  # threads of a warpgroup
FP8_TARGET_EXP = 7  # scale hi/lo operands so their max lies in [2^7, 2^8)


def fabs(x):
    return cute.arch.fmax(x, -x)


def exp_floor(x):
    """floor(log2 x) for x > 0 (x = 0 -> a huge negative clamp), as an exact FP32 integer."""
    return cute.math.floor(cute.math.log2(cute.arch.fmax(x, Float32(1e-30)), fastmath=True))


def pow2_scale(x):
    """2^(FP8_TARGET_EXP - floor(log2 x)): puts x > 0 into [2^7, 2^8). exp2 of an integer is exact."""
    return cute.math.exp2(Float32(FP8_TARGET_EXP) - exp_floor(x), fastmath=True)


def max4(buf, o):
    """Max of the four per-warp partials buf[o .. o+3]."""
    return cute.arch.fmax(cute.arch.fmax(buf[o], buf[o + 1]), cute.arch.fmax(buf[o + 2], buf[o + 3]))


def hilo(x):
    """FP8 E4M3 hi/lo split of x (|x| < 256): fp8(x), fp8(x - fp8(x))."""
    hi = x.to(Float8E4M3FN)
    return hi, (x - hi.to(Float32)).to(Float8E4M3FN)


def scalar(ptr, idx):
    """The one-element tensor at ``ptr + idx`` (read or write with ``[0]``)."""
    return cute.make_tensor(ptr + idx, cute.make_layout((1,)))


def load_acc(t2r, thr_t2r, acc, nm: int):
    """One TMEM accumulator row (lane = thread of the warpgroup), nm fp32 columns -> registers."""
    src = thr_t2r.partition_S(acc[(None, None), 0, 0])  # (T2R, 1, 1)
    dst = cute.make_rmem_tensor(thr_t2r.partition_D(acc[(None, None), 0, 0]).shape, Float32)
    cute.copy(t2r, src, dst)
    return cute.make_tensor(dst.iterator, cute.make_layout((nm,)))
