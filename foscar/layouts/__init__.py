"""Packed-code and tile layouts.

Every arch reads the same tile sizes (64 tokens x head_dim of one KV head, same tensor shapes) but
wants its own bit order inside a tile: ``hopper`` is the mma.sync A-fragment order (fragment.py),
``blackwell`` runs of consecutive reduction-axis elements per word (blackwell.py). Which arch
reads which: ``foscar.archs``.
"""

from .blackwell import bw_pack_tiles, bw_unpack_tiles
from .fragment import TILE_TOKENS, TileGeometry, evaluate_layout, tile_layout, tile_position
from .packing import pack_tiles, unpack_tiles

PACKERS = {"hopper": (pack_tiles, unpack_tiles), "blackwell": (bw_pack_tiles, bw_unpack_tiles)}

__all__ = [
    "PACKERS",
    "TILE_TOKENS",
    "TileGeometry",
    "evaluate_layout",
    "tile_layout",
    "tile_position",
    "pack_tiles",
    "unpack_tiles",
]
