"""Where a Blackwell decode CTA's sequence lives: its packed length, its page-table row, its split's
64-token tiles and the number of partials per query row, for the two launches that run the
kernel (``foscar.decode``'s and ``foscar.cache.PagedKVCache``'s).

The objects only hold the launch's arguments and the CTA's coordinates; every value is computed
when a role asks, after the role dispatch (``BlackwellDecodeKernel.kernel``), so nothing stays live
across it.
"""

from __future__ import annotations

import cutlass
from cutlass import Int32, Int64

from ..window_tiles import quantized_tokens
from ..layouts.fragment import TILE_TOKENS
from ..pipeline import TileSpan
from .primitives import STEP, scalar

STEP_TILES = STEP // TILE_TOKENS  # 64-token tiles per 128-token step

__all__ = ["DecodeSequence", "CacheSequence", "STEP_TILES"]


class DecodeSequence:
    """``foscar.decode``: batch entry ``b`` is page-table row ``b``, ``lengths[b]`` tokens, all packed;
    ``num_splits`` partials per query row."""

    def __init__(self, page_table, lengths, max_pages, b, split, num_splits):
        self.page_table, self.lengths, self.max_pages = page_table, lengths, max_pages
        self.b, self.split, self.num_splits = b, split, num_splits

    def packed_tokens(self):
        return scalar(self.lengths, self.b)[0]

    def table_row(self):
        return self.b.to(Int64)

    def partials(self):
        """Partials per query row: the stride of the split output."""
        return self.num_splits

    def tiles(self) -> TileSpan:
        """The CTA's packed tiles (``foscar.pipeline.TileSpan``): whole 128-token steps per split."""
        return TileSpan.of_split(self.packed_tokens(), self.split, self.num_splits, STEP_TILES)

    def tile_head(self, kv_heads, h, n_tiles, tile, page_size: int):
        """(page * kv_heads + h, tile-in-page, first slot) of 64-token tile ``tile`` (clamped in range)."""
        tile = cutlass.min(tile, n_tiles - 1)
        tok0 = tile * TILE_TOKENS
        page = scalar(self.page_table, self.table_row() * self.max_pages + tok0 // page_size)[0]
        return page.to(Int64) * kv_heads + h, (tok0 % page_size) // TILE_TOKENS, tok0 % page_size


class CacheSequence(DecodeSequence):
    """``PagedKVCache``: batch entry ``b`` is the cache's sequence row ``seq_rows[b]`` (int64), whose
    ``seq_lengths[row]`` tokens (int64) keep ``quantized_tokens`` of them packed (the rest in the
    16-bit sink + window, ``foscar.kernels.sink_window``); ``total`` partials per query row, this
    launch writing the first ``num_splits``."""

    def __init__(self, page_table, seq_rows, seq_lengths, max_pages, b, split, num_splits, total, sink, window,
                 granule: int):
        super().__init__(page_table, seq_lengths, max_pages, b, split, num_splits)
        self.seq_rows, self.total = seq_rows, total
        self.sink, self.window, self.granule = sink, window, granule

    def table_row(self):
        return scalar(self.seq_rows, self.b)[0]

    def packed_tokens(self):
        n = Int32(scalar(self.lengths, self.table_row())[0])
        return quantized_tokens(n, self.sink, self.window, self.granule)

    def partials(self):
        return self.total
