"""The packed-code maps of :mod:`foscar.layouts.fragment` as real CuTe layouts.

``fragment.tile_layout`` writes the map (token, channel) -> code position ``q`` as nested
(shape, stride) tuples; this module turns it into ``cute.Layout`` objects that kernels index with
dynamic coordinates (the DSL folds the power-of-two divisions into shifts and masks). Call these
inside ``@cute.jit`` / ``@cute.kernel`` code: a CuTe layout needs the DSL's IR context.

Codes are addressed by bit: the code at position ``q`` occupies bits ``q*bits .. q*bits+bits-1`` of
the tile's little-endian stream of 32-bit words, so :func:`bit_layout` (the same layout with every
stride times ``bits``) gives word ``b >> 5`` and shift ``b & 31`` directly.
"""

from __future__ import annotations

import cutlass.cute as cute

from .fragment import TileGeometry, tile_layout

__all__ = ["code_layout", "bit_layout", "scale_strides"]


def scale_strides(stride, factor: int):
    """Multiply every leaf of a nested stride tuple by ``factor``."""
    if isinstance(stride, tuple):
        return tuple(scale_strides(s, factor) for s in stride)
    return stride * factor


def code_layout(geom: TileGeometry) -> cute.Layout:
    """(token, channel) -> code position ``q`` in the packed tile; modes hierarchical, token first."""
    shape, stride = tile_layout(geom)
    return cute.make_layout(shape, stride=stride)


def bit_layout(geom: TileGeometry) -> cute.Layout:
    """(token, channel) -> first bit of the code in the tile's bit stream (word = b>>5, shift = b&31)."""
    shape, stride = tile_layout(geom)
    return cute.make_layout(shape, stride=scale_strides(stride, geom.bits))
