"""Device building blocks of the sm_100a decode kernel and its fold hooks: the warpgroup geometry
(its named barriers: ``foscar.barriers``), FP8 B operands in pieces (hi, lo, ...) with power-of-two normalisation,
and TMEM row loads."""

from __future__ import annotations

import cutlass.cute as cute
import torch
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


def fp8_pieces(x, n: int) -> list:
    """x (|x| < 256) as ``n`` FP8 E4M3 values whose exact sum carries ~4n significant bits: fp8(x), then fp8 of
    what is left (each rest is exact in FP32)."""
    pieces = []
    for _ in range(n):
        piece = x.to(Float8E4M3FN)
        pieces.append(piece)
        x = x - piece.to(Float32)
    return pieces


def fp8_piece_options(q_dtype) -> tuple:
    """The FP8 piece counts of the B operands (Q' and P') to try, most first (``BlackwellConfig`` takes the first
    whose TMEM fits). BF16 (8 significant bits) is as exact in hi + lo as the BF16 computation the accuracy rule
    measures against. FP16 (11 bits) is not: in float64 emulation (``tests/test_blackwell.py``) hi + lo put the lse
    off by up to ~1.5e-2 (token-wise K: K's channel means turn Q's rounding into a shift of every score) and the
    output up to 1.5x past the rule of an FP16 computation (token-wise K and V). FP16 takes four pieces (three
    would hold its bits, but a TMEM load takes a power-of-two count of columns, N x pieces); hi + lo where four do
    not fit the TMEM."""
    return (2,) if q_dtype != torch.float16 else (4, 2)


def piece_sum(acc, col, n: int, pieces: int):
    """Accumulator column ``col`` of a B operand split in ``pieces`` (its columns ``col + k * n``), summed."""
    total = acc[col]
    for k in range(1, pieces):
        total = total + acc[col + k * n]
    return total


def scalar(ptr, idx):
    """The one-element tensor at ``ptr + idx`` (read or write with ``[0]``)."""
    return cute.make_tensor(ptr + idx, cute.make_layout((1,)))


def load_acc(t2r, thr_t2r, acc, nm: int):
    """One TMEM accumulator row (lane = thread of the warpgroup), nm fp32 columns -> registers."""
    src = thr_t2r.partition_S(acc[(None, None), 0, 0])  # (T2R, 1, 1)
    dst = cute.make_rmem_tensor(thr_t2r.partition_D(acc[(None, None), 0, 0]).shape, Float32)
    cute.copy(t2r, src, dst)
    return cute.make_tensor(dst.iterator, cute.make_layout((nm,)))
