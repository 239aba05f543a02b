"""Torch packer: integer codes of 64-token tiles <-> packed int32 words.

``position(geom, token, channel)`` gives each code's place in the tile's bit stream (code ``q`` in
word ``q // cpw`` at bit ``(q % cpw) * bits``): ``fragment.tile_position`` for the Hopper order,
``blackwell.bw_tile_position`` for the Blackwell one.
"""

from __future__ import annotations

import functools

import torch

from .fragment import TILE_TOKENS, TileGeometry, tile_position


@functools.lru_cache(maxsize=None)
def _code_order(geom: TileGeometry, position) -> torch.Tensor:
    """order[q] = token * head_dim + channel of the code at bit-stream position q."""
    order = torch.empty(TILE_TOKENS * geom.head_dim, dtype=torch.long)
    for token in range(TILE_TOKENS):
        for channel in range(geom.head_dim):
            order[position(geom, token, channel)] = token * geom.head_dim + channel
    return order


def pack_tiles(codes: torch.Tensor, geom: TileGeometry, position=tile_position) -> torch.Tensor:
    """codes ``[..., 64, head_dim]`` (integers in [0, 2^bits)) -> int32 words ``[..., tile_words]``."""
    if codes.shape[-2:] != (TILE_TOKENS, geom.head_dim):
        raise ValueError(f"codes must end in ({TILE_TOKENS}, {geom.head_dim}), got {tuple(codes.shape)}")
    lead = codes.shape[:-2]
    stream = codes.reshape(*lead, -1)[..., _code_order(geom, position).to(codes.device)].to(torch.int64)
    stream = stream.reshape(*lead, geom.words, geom.codes_per_word)
    shifts = torch.arange(geom.codes_per_word, device=codes.device, dtype=torch.int64) * geom.bits
    words = (stream << shifts).sum(-1)  # disjoint bit fields: the sum is an OR
    return (words - ((words >> 31) << 32)).to(torch.int32)  # wrap to signed 32 bit


def unpack_tiles(words: torch.Tensor, geom: TileGeometry, position=tile_position) -> torch.Tensor:
    """int32 words ``[..., tile_words]`` -> uint8 codes ``[..., 64, head_dim]``."""
    if words.shape[-1] != geom.words:
        raise ValueError(f"words must end in {geom.words}, got {tuple(words.shape)}")
    lead = words.shape[:-1]
    shifts = torch.arange(geom.codes_per_word, device=words.device, dtype=torch.int64) * geom.bits
    stream = (words.to(torch.int64)[..., None] >> shifts) & (2**geom.bits - 1)
    stream = stream.reshape(*lead, -1)
    codes = torch.empty_like(stream)
    codes[..., _code_order(geom, position).to(words.device)] = stream
    return codes.reshape(*lead, TILE_TOKENS, geom.head_dim).to(torch.uint8)
