"""Code -> Tensor Core operand recipes, as bit operations, with torch emulations that prove them.

The kernels use the constants here; the tests run the same bit operations on the CPU and check
that every operand equals ``Construction.operand(code)`` exactly (``foscar.scheme``).

Hopper (FP16, mma.sync with A in registers): register ``n`` of a thread holds codes at bit ``bits*(n % (16/bits))``
(+16 for the second half, ``foscar.layouts.fragment``). One shift brings both codes to the top
``bits`` mantissa bits of each FP16 half, one LOP3 masks them and ORs in 1.0::

    op = ((word >> shift) & mask) | 0x3C003C00      # == f16x2(1 + c0/2^bits, 1 + c1/2^bits)

Codes in the *top* mantissa bits keep the construction bias small (operand in [1, 2)), which
loses ~``bits`` bits of FP32 to cancellation where a code in the low mantissa bits of 1024.0
would lose 10. FP16 rather than BF16 because the other MMA operand (Q or P times a group scale)
is rounded to the MMA type: FP16's 10-bit mantissa makes that rounding 4x smaller than BF16's,
which is what keeps the kernels within 2x of a BF16 PyTorch computation's error.

Blackwell (tcgen05 kind::f8f6f4): an INT2 code zero-extended into an E2M1 nibble encodes ``c/2``;
an INT4 code zero-extended into a byte encodes ``c * 2^-9`` in E4M3 (``foscar/blackwell/operands.py``
has the word-level recipes of the Blackwell layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layouts import TileGeometry
from .layouts.fragment import THREADS

FP16_ONE_X2 = 0x3C003C00
FP16_MANTISSA = 10
# The offset corrections use the *rounded* scaled operand (q*s' or p*s' in FP16), so that the operand
# bias 1 cancels exactly against its rounding; below this scale the scaled operand may be an FP16
# subnormal, and the correction uses the unrounded operand instead (error ~ s', not ~ x/s').
EXACT_CANCEL_MIN_SCALE = 2.0**-6


@dataclass(frozen=True)
class HopperRecipe:
    """Shift/mask constants of the Hopper FP16 construction for ``bits``."""

    bits: int

    @property
    def mask(self) -> int:
        return ((2**self.bits - 1) << (FP16_MANTISSA - self.bits)) * 0x00010001

    def right_shift(self, k: int) -> int:
        """Right shift (negative: left) that moves register slot ``k``'s codes to the top mantissa."""
        return self.bits * k - (FP16_MANTISSA - self.bits)

    def build(self, words: torch.Tensor, k: int) -> torch.Tensor:
        """Operand f16x2 words (int64 holding 32 bits) for slot ``k`` of int32 ``words``."""
        u = words.to(torch.int64) & 0xFFFFFFFF
        shift = self.right_shift(k)
        u = (u >> shift) if shift >= 0 else ((u << -shift) & 0xFFFFFFFF)
        return (u & self.mask) | FP16_ONE_X2


def _f16_bits_to_float(bits16: torch.Tensor) -> torch.Tensor:
    return (bits16 - ((bits16 >> 15) << 16)).to(torch.int16).view(torch.float16).to(torch.float64)


def hopper_tile_operands(words: torch.Tensor, geom: TileGeometry) -> torch.Tensor:
    """Emulate what every consumer thread builds from one packed tile.

    Walks threads and fragment registers exactly as the kernel does (vector loads, one recipe per
    register) and scatters each operand value to its (token, channel). Returns float64 ``[64, D]``.
    """
    recipe = HopperRecipe(geom.bits)
    ppw, cw = geom.regs_per_word, geom.vector_words
    out = torch.full((64, geom.head_dim), torch.nan, dtype=torch.float64)
    thread = torch.arange(THREADS)
    warp, lane = thread // 32, thread % 32
    g, tq = lane // 4, lane % 4
    for n in range(geom.regs_per_thread):
        j, wi, k = n // (ppw * cw), (n // ppw) % cw, n % ppw
        word = words[(j * THREADS + thread) * cw + wi]
        op = recipe.build(word, k)
        mt_kb, reg = divmod(n, 4)
        mt, kb = divmod(mt_kb, geom.k_blocks)
        h_r, h_c = reg % 2, reg // 2
        row = mt * 64 + 16 * warp + 8 * h_r + g
        for e, half in ((0, op & 0xFFFF), (1, op >> 16)):
            col = 16 * kb + 8 * h_c + 2 * tq + e
            token, channel = (row, col) if geom.role == "k" else (col, row)
            out[token, channel] = _f16_bits_to_float(half)
    return out


def e2m1_value(nibbles: torch.Tensor) -> torch.Tensor:
    """Decode FP4 E2M1 nibbles (sign, 2 exponent bits, 1 mantissa bit, bias 1) to float64."""
    n = nibbles.to(torch.int64) & 0xF
    sign = torch.where(n & 0x8 != 0, -1.0, 1.0).to(torch.float64)
    exp, man = (n >> 1) & 0x3, (n & 1).to(torch.float64)
    normal = (1 + man / 2) * torch.pow(2.0, (exp - 1).to(torch.float64))
    return sign * torch.where(exp == 0, man / 2, normal)


def blackwell_int2_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """INT2 codes zero-extended into E2M1 nibbles: the bit pattern is the code itself."""
    return codes.to(torch.int64) & 0x3


def blackwell_int4_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """INT4 codes zero-extended into bytes: byte ``c`` is the E4M3 encoding of ``c * 2^-9``."""
    return codes.to(torch.uint8) & 0xF


def e4m3_value(bytes_: torch.Tensor) -> torch.Tensor:
    return bytes_.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
