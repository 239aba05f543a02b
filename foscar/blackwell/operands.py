"""Blackwell (tcgen05 ``kind::f8f6f4``) operand recipes: packed codes -> FP4/FP8 bits, and back.

Constructions (``foscar.scheme.Construction``: ``operand = a*c + b``, exact, ``b = 0`` for both):

* INT2 -> FP4 E2M1, ``BLACKWELL_FP4`` (``a = 1/2``): the code zero-extended into a nibble.
* INT4 -> FP8 E4M3, ``scheme.BLACKWELL_FP8`` (``a = 2^-9``): the code zero-extended into a
  byte; bytes 0..7 are the E4M3 subnormals ``c * 2^-9``, bytes 8..15 the first normal binade
  ``2^-6 * (1 + (c-8)/8) = c * 2^-9``. One mask per 4 codes instead of a 16-entry PRMT table
  for E4M3(c); the folded scale is ``512*s``.
  (Relies on the Tensor Core honouring E4M3 subnormal inputs, which the FP8 formats define.)

Recipe per packed word ``w`` (``foscar.layouts.blackwell`` word order)::

    lo = w & MASK                 # LOP3      elements 0 .. E/2-1
    hi = (w >> bits) & MASK       # SHF + LOP3 elements E/2 .. E-1
    8 bytes (lo, hi) -> shared memory: 16 FP4 nibbles (b4x16_p64 chunk) or 8 E4M3 bytes

``MASK`` = 0x33333333 (INT2) or 0x0F0F0F0F (INT4). :func:`tile_operands` runs exactly this on the
CPU and decodes the resulting bits, so a test can compare codes -> bits -> values bit-exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layouts.blackwell import BlackwellTile
from ..layouts.fragment import TileGeometry
from ..operands import e2m1_value, e4m3_value
from ..scheme import Construction
from ..scheme import construction_for as scheme_construction_for

__all__ = [
    "construction_for",
    "build_word",
    "tile_operand_bits",
    "tile_operands",
    "operand_dtype_name",
    "OperandRecipe",
    "recipe_for",
]

def construction_for(bits: int) -> Construction:
    """The construction the sm_100a kernel uses for ``bits``."""
    return scheme_construction_for("sm_100a", bits)


def operand_dtype_name(bits: int) -> str:
    return construction_for(bits).operand_dtype


@dataclass(frozen=True)
class OperandRecipe:
    """The recipe of one tensor (K or V, each with its own bits): packed word -> 8 operand bytes.

    ``tile``: the 64-token tile in the Blackwell word order; ``construction``: the ``a*c + b`` the
    plan folds (``fold.construction``); :attr:`mma_dtype` is the A format of the tensor's MMA."""

    tile: BlackwellTile
    construction: Construction

    @property
    def bits(self) -> int:
        return self.tile.bits

    @property
    def mask(self) -> int:
        return self.tile.mask

    @property
    def elems_per_word(self) -> int:
        return self.tile.elems_per_word

    @property
    def words(self) -> int:
        """int32 words of a 64-token tile."""
        return self.tile.words

    @property
    def vectors(self) -> int:
        """16-byte vectors of a tile (the preparation warpgroup's loads)."""
        return self.words // 4

    @property
    def mma_dtype(self):
        """The CuTe type of the MMA's A operand (the instruction descriptor's format)."""
        from cutlass import Float4E2M1FN, Float8E4M3FN

        return Float4E2M1FN if self.construction.operand_dtype == "float4_e2m1fn" else Float8E4M3FN

    def build(self, w):
        """Device: (lo, hi) Int32 operand words of the Uint32 packed word ``w``: one LOP3, then one
        SHF + one LOP3 (the 8 bytes of one K-mode chunk)."""
        import cutlass.cute as cute
        from cutlass import Int32, Uint32

        lo = Int32(cute.arch.lop3(w, Uint32(self.mask), Uint32(0), 0xC0))
        hi = Int32(cute.arch.lop3(w >> self.tile.shift, Uint32(self.mask), Uint32(0), 0xC0))
        return lo, hi


def recipe_for(fold) -> OperandRecipe:
    """The recipe of a plan's fold case (``scheme.plan("sm_100a").k`` or ``.v``): its bits choose
    FP4 (INT2) or FP8 (INT4), independently for K and V."""
    if fold.construction != construction_for(fold.bits):
        raise ValueError(f"{fold.name}: the sm_100a kernel builds {construction_for(fold.bits).name} operands "
                         f"from {fold.bits}-bit codes, the plan folds {fold.construction.name}")
    return OperandRecipe(BlackwellTile(fold.tensor, fold.bits, fold.head_dim), fold.construction)


def build_word(words: torch.Tensor, bits: int):
    """(lo, hi) 32-bit operand words (int64 holding 32 bits) of packed int32 ``words``."""
    tile = BlackwellTile("k", bits, 64)
    u = words.to(torch.int64) & 0xFFFFFFFF
    return u & tile.mask, (u >> tile.shift) & tile.mask


def tile_operand_bits(words: torch.Tensor, geom: TileGeometry) -> torch.Tensor:
    """Operand element bit patterns ``[rows, cols]`` (nibbles or bytes) as the kernel stores them.

    ``rows``/``cols`` are the MMA's M and K modes (tokens x channels for K, channels x tokens for V).
    """
    tile = BlackwellTile(geom.role, geom.bits, geom.head_dim)
    lo, hi = build_word(words, geom.bits)
    width = 4 if geom.bits == 2 else 8
    per = 32 // width  # elements per output word
    shifts = torch.arange(per, dtype=torch.int64) * width
    elo = (lo[:, None] >> shifts) & ((1 << width) - 1)  # [words, per]
    ehi = (hi[:, None] >> shifts) & ((1 << width) - 1)
    elems = torch.cat([elo, ehi], dim=1)  # [words, E]: consecutive K elements
    return elems.reshape(tile.rows, tile.cols)


def tile_operands(words: torch.Tensor, geom: TileGeometry) -> torch.Tensor:
    """Operand values ``[64 tokens, head_dim]`` (float64) the kernel feeds the MMA for one tile."""
    bits_ = tile_operand_bits(words, geom)
    values = e2m1_value(bits_) if geom.bits == 2 else e4m3_value(bits_.to(torch.uint8))
    return values if geom.role == "k" else values.T.contiguous()
