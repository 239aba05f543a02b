"""Blackwell packed-code layout: one 32-bit word = one MMA-operand chunk along the reduction axis.

The sm_100a kernel builds its KV operands in *shared memory* (tcgen05 reads A through a smem
descriptor), not in registers, so the Hopper order (wgmma A-fragment order, ``fragment.py``) buys
nothing there. What the FP4/FP8 constructions want instead is that one word, after one mask and one
shift+mask, *is* a run of consecutive reduction-axis (K-mode) operand elements:

* INT2 -> FP4 E2M1 (``kind::f8f6f4``; a code ``c`` zero-extended into a nibble is ``c/2``): a word
  holds ``E = 16`` consecutive K elements; element ``k`` sits at bits ``4k`` (``k < 8``) or
  ``4(k-8) + 2`` (``k >= 8``). Then ``w & 0x33333333`` is the packed E2M1 nibbles of elements
  0..7 (element ``k`` in nibble ``k``, the little-endian FP4 packing order) and
  ``(w >> 2) & 0x33333333`` those of elements 8..15: 8 bytes = one 16-element FP4 chunk from
  1 LOP3 + 1 SHF + 1 LOP3 = 3 ALU instructions per 16 elements (0.19 per element; the paper's
  B200 figure). In shared memory ``kind::f8f6f4`` wants FP4 in the padded ``b4x16_p64`` format
  (16 nibbles in 8 bytes + 8 bytes of padding), so the chunk is one 8-byte store.
* INT4 -> FP8 E4M3: a word holds ``E = 8`` consecutive K elements; element ``k`` at bits ``8k``
  (``k < 4``) or ``8(k-4) + 4`` (``k >= 4``). ``w & 0x0F0F0F0F`` gives bytes ``c`` of elements
  0..3 and ``(w >> 4) & 0x0F0F0F0F`` of elements 4..7. A byte ``c`` in 0..15 *is* the E4M3
  encoding of ``c * 2^-9`` (subnormals 0..7, then the first normal binade 8..15 with the same
  spacing): exact, and again 3 ALU instructions per 8 elements (0.375 per element), no PRMT table.

In general element ``k`` of a word sits in code slot ``2*(k % (E/2)) + k // (E/2)`` (slot = bit /
bits). Words are row-major over (row, chunk): ``row`` is the MMA M index (a token for K, a channel
for V, whose A operand is V^T), ``chunk`` the K-mode run. Thread ``t`` of the preparation warpgroup
loads 16-byte vectors ``t, t + 128, ...`` (4 words: 4 consecutive chunks of one row), so a warp's
loads are contiguous. Same tile sizes as ``fragment.TileGeometry`` (64 tokens x head_dim).
"""

from __future__ import annotations


import torch

from .fragment import TileGeometry
from .packing import pack_tiles, unpack_tiles

__all__ = [
    "BlackwellTile",
    "bw_tile_position",
    "bw_pack_tiles",
    "bw_unpack_tiles",
    "INT2_NIBBLE_MASK",
    "INT4_BYTE_MASK",
]

INT2_NIBBLE_MASK = 0x33333333  # keeps one 2-bit code in the low half of every nibble
INT4_BYTE_MASK = 0x0F0F0F0F  # keeps one 4-bit code in the low half of every byte
VECTOR_WORDS = 4  # 16-byte loads


class BlackwellTile(TileGeometry):
    """A 64-token tile in the Blackwell word order (same sizes as the Hopper TileGeometry)."""

    @property
    def elems_per_word(self) -> int:  # E: consecutive K-mode elements in one word
        return 32 // self.bits

    @property
    def chunks_per_row(self) -> int:
        return self.cols // self.elems_per_word

    @property
    def shift(self) -> int:  # right shift that brings the second half of a word under the mask
        return self.bits

    @property
    def mask(self) -> int:
        return INT2_NIBBLE_MASK if self.bits == 2 else INT4_BYTE_MASK


def element_slot(bits: int, k: int) -> int:
    """Code slot (bit // bits) of element ``k`` of a word."""
    half = 16 // bits
    return 2 * (k % half) + k // half


def bw_tile_position(geom: TileGeometry, token: int, channel: int) -> int:
    """Linear code position ``q`` (word ``q // cpw``, bit ``(q % cpw)*bits``) of (token, channel)."""
    tile = BlackwellTile(geom.role, geom.bits, geom.head_dim)
    row, col = (token, channel) if geom.role == "k" else (channel, token)
    chunk, k = divmod(col, tile.elems_per_word)
    word = row * tile.chunks_per_row + chunk
    return word * tile.codes_per_word + element_slot(geom.bits, k)


def _geom(geom: TileGeometry) -> TileGeometry:
    """The plain geometry (a BlackwellTile compares unequal to it, and the packer caches per geometry)."""
    return TileGeometry(geom.role, geom.bits, geom.head_dim)


def bw_pack_tiles(codes: torch.Tensor, geom: TileGeometry) -> torch.Tensor:
    """codes ``[..., 64, head_dim]`` -> int32 words ``[..., tile_words]`` in the Blackwell order."""
    return pack_tiles(codes, _geom(geom), bw_tile_position)


def bw_unpack_tiles(words: torch.Tensor, geom: TileGeometry) -> torch.Tensor:
    """int32 words ``[..., tile_words]`` (Blackwell order) -> uint8 codes ``[..., 64, head_dim]``."""
    return unpack_tiles(words, _geom(geom), bw_tile_position)
