"""Packed-code and tile layouts shared by both arches (see fragment.py for the bit layout)."""

from .fragment import TILE_TOKENS, TileGeometry, evaluate_layout, tile_layout, tile_position
from .packing import pack_tiles, unpack_tiles

__all__ = ["TILE_TOKENS", "TileGeometry", "evaluate_layout", "tile_layout", "tile_position", "pack_tiles", "unpack_tiles"]
