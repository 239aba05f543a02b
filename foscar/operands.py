"""Code -> Tensor Core operand recipes, as bit operations, with torch emulations that prove them.

The kernels use the constants here; the tests run the same bit operations on the CPU and check
that every operand equals ``Construction.operand(code)`` exactly (``foscar.scheme``).

Hopper (FP16, mma.sync with A in registers): register ``n`` of a thread holds codes at bit
``bits*(n % (16/bits))`` (+16 for the second half, ``foscar.layouts.fragment``). A code that lies
at mantissa bits ``[p, p + bits)`` of an FP16 with exponent ``E = 10 - bits - p`` makes the value
``2^E + c/2^bits``: the same code weight ``1/2^bits`` in every slot, only the bias ``2^E`` differs.
So the slots inside the 10-bit mantissa need no shift at all (one LOP3 each), one shift right by 6
per word brings the top slots of each half into the mantissa, and one shift left by 6 lifts the
bottom slots up it (a code low in the mantissa carries a large bias)::

    op = ((word << 6) & mask[k]) | magic[k]        # slots with bits*k + 6 + bits <= 10
    op = (word & mask[k]) | magic[k]               # the other slots inside the mantissa
    op = ((word >> 6) & mask[k]) | magic[k]        # the top of each half

INT2: 10 instructions per 16 codes (biases 4, 1, 16, 4, 1, 16, 4, 1); INT4: 6 per 8 codes
(biases 1, 4, 16, 1). The bias never reaches the folding algebra: it depends only on the slot,
i.e. on the reduction index and the accumulator row parity (``bias_slot``), so the kernel
removes it inside the accumulator with one more MMA against a constant A fragment of ``-bias``
(exact powers of two; ``-(bias - b)`` for centred codes, below) and the *same* rounded B operand the data MMA
multiplies. What is left is ``c/2^bits`` (``HOPPER_FP16``: ``a = 1/2^bits, b = 0``), and the offset corrections
take the unrounded Q or P. The same MMA centres the codes where the fold wants them centred
(``foscar.folds.fold_case``): a constant ``-(bias + centre/2^bits)`` (:func:`cancel_word`, still an exact FP16)
leaves ``(c - centre)/2^bits``, the construction's ``b = -centre/2^bits``. The cancellation of a bias up to 16
(64x the INT2 code weight) costs FP32 accumulator bits, in proportion to the largest bias: the MMA's
accumulation truncates, and with the biases of the unlifted slots (up to 256) the H200's score error was 21x (INT2)
and 5x (INT4) larger
(benchmarks/NOTES.md section 44; the shift left runs as an IMAD.SHL, off the LOP3s' ALU pipe). FP16 rather than BF16
because the other MMA operand (Q or P times a group scale) is rounded to the MMA type: FP16's
10-bit mantissa makes that rounding 4x smaller than BF16's, which is what keeps the kernels within
2x of a BF16 PyTorch computation's error.

Blackwell (tcgen05 kind::f8f6f4): an INT2 code zero-extended into an E2M1 nibble encodes ``c/2``;
an INT4 code zero-extended into a byte encodes ``c * 2^-9`` in E4M3 (``foscar/blackwell/operands.py``
has the word-level recipes of the Blackwell layout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .layouts import TileGeometry
from .layouts.fragment import THREADS

FP16_MANTISSA = 10
HALF_BITS = 16
# one shift right per word brings the top code of each FP16 half to the top of its mantissa, one shift left the
# bottom codes up it (HopperRecipe)
SHARED_SHIFT = HALF_BITS - FP16_MANTISSA


def _f16x2(value: float) -> int:
    """Bits of an FP16 power of two ``value``, in both halves of a 32-bit word."""
    exponent = round(math.log2(value))
    assert value == 2.0**exponent and -14 <= exponent <= 15
    return ((exponent + 15) << FP16_MANTISSA) * 0x00010001


@dataclass(frozen=True)
class HopperSlot:
    """How register slot ``k`` of a packed word becomes an f16x2 operand ``bias + c/2^bits``."""

    shift: int  # shift of the word: right by ``shift`` (SHARED_SHIFT), left by ``-shift`` (-SHARED_SHIFT), or none
    mask: int  # the slot's two codes, after the shift, at mantissa bits [p, p + bits) of each half
    magic: int  # f16x2 exponent bits of 2^E, E = 10 - bits - p
    bias: float  # 2^E: the operand is bias + c/2^bits


@dataclass(frozen=True)
class HopperRecipe:
    """Per-slot shift/mask/magic constants of the Hopper FP16 construction for ``bits``."""

    bits: int

    @property
    def slots(self) -> tuple[HopperSlot, ...]:
        out = []
        for k in range(HALF_BITS // self.bits):
            low = self.bits * k  # the slot's code bits in the word's low half
            if low + self.bits > FP16_MANTISSA:
                shift = SHARED_SHIFT  # the top of each half, down into the mantissa
            elif low + SHARED_SHIFT + self.bits <= FP16_MANTISSA:
                shift = -SHARED_SHIFT  # the bottom of each half, up: a smaller bias (see the module doc)
            else:
                shift = 0
            p = low - shift
            bias = 2.0 ** (FP16_MANTISSA - self.bits - p)
            out.append(HopperSlot(shift, ((2**self.bits - 1) << p) * 0x00010001, _f16x2(bias), bias))
        return tuple(out)

    def build(self, words: torch.Tensor, k: int) -> torch.Tensor:
        """Operand f16x2 words (int64 holding 32 bits) for slot ``k`` of int32 ``words``."""
        slot = self.slots[k]
        w = words.to(torch.int64) & 0xFFFFFFFF
        return ((w >> slot.shift if slot.shift >= 0 else w << -slot.shift) & slot.mask) | slot.magic


def cancel_word(bias: float, offset) -> int:
    """f16x2 bits, both halves, of the constant ``-(bias - offset)``: an MMA of it with the B operand a slot's operands
    ``bias + c/2^bits`` multiply leaves ``c/2^bits + offset`` (``offset``: the construction's ``b``, non-zero for
    centred codes). It must be an exact FP16, as the powers of two of ``-bias`` are."""
    value = float(offset) - bias
    half = torch.tensor(value, dtype=torch.float16)
    if float(half) != value:
        raise ValueError(f"the cancelling constant {value} of a slot of bias {bias} is not an exact FP16")
    return (int(half.view(torch.int16)) & 0xFFFF) * 0x00010001


def bias_slot(regs_per_word: int, k_block: int, reg: int) -> int:
    """Slot of A-fragment register ``reg`` (= h_r + 2*h_c) of k16 block ``k_block``: the bias an
    MMA over that block meets depends only on the block's parity and the register, i.e. on the
    reduction index and the accumulator row parity h_r, never on the row itself."""
    return (4 * k_block + reg) % regs_per_word


def hopper_tile_biases(geom: TileGeometry) -> torch.Tensor:
    """The bias of every (token, channel) operand of a tile, float64 ``[64, D]``, from
    :func:`bias_slot` alone (what the kernel's constant bias fragments assume)."""
    slots = HopperRecipe(geom.bits).slots
    out = torch.empty((64, geom.head_dim), dtype=torch.float64)
    for token in range(64):
        for channel in range(geom.head_dim):
            row, col = (token, channel) if geom.role == "k" else (channel, token)
            reg = (row % 16) // 8 + 2 * ((col % 16) // 8)  # h_r + 2*h_c
            out[token, channel] = slots[bias_slot(geom.regs_per_word, col // 16, reg)].bias
    return out


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
