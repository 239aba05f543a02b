"""Where a Blackwell decode CTA's sequence lives: its packed length, its page-table row, its split's
64-token tiles and the number of partials per query row, for the two launches that run the
kernel (``foscar.decode``'s and ``foscar.cache.PagedKVCache``'s: a work item of its work list).

The objects only hold the launch's arguments and the CTA's coordinates; every value is computed
when a role asks, after the role dispatch (``BlackwellDecodeKernel.kernel``), so nothing stays live
across it.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..device import divmod_nonnegative
from ..window_tiles import quantized_tokens
from ..layouts.fragment import TILE_TOKENS
from ..pipeline import TileSpan
from .primitives import STEP, scalar

STEP_TILES = STEP // TILE_TOKENS  # 64-token tiles per 128-token step

__all__ = ["DecodeSequence", "PlannedSequence", "PlannedHead", "WindowQuery", "STEP_TILES"]


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

    def tile_page(self, n_tiles, tile, page_size: int):
        """(page, tile-in-page, first slot) of 64-token tile ``tile`` (clamped in range)."""
        tile = cutlass.min(tile, n_tiles - 1)
        page_of_row, slot0 = divmod_nonnegative(tile * TILE_TOKENS, page_size)
        page = scalar(self.page_table, self.table_row() * self.max_pages + page_of_row)[0]
        return page, slot0 // TILE_TOKENS, slot0


class PlannedSequence(DecodeSequence):
    """``PagedKVCache``'s one-launch decode: the CTA attends the work item that ``work``
    (``foscar.work_list.WorkList``) planned into the shared words ``areas.plan`` (``areas``: the cache decode's
    shared areas, ``foscar.blackwell.window.cache_areas``), read again whenever a role asks
    (:meth:`item`: ``(b, h, part, parts, first item, (tokens, row), valid)``; the CTA's index read again too, so
    no register holds it across the role dispatch): part ``part`` of ``parts`` of
    cache row ``row``'s packed pages, whose ``seq_lengths[row]`` tokens keep ``quantized_tokens`` of them
    packed, the rest in the 16-bit ``slots`` (``foscar.window_tiles.WindowSlots``), which the softmax warpgroup
    attends with ``query`` (:class:`WindowQuery`)."""

    def __init__(self, work, areas, page_table, max_pages, slots, granule: int, query):
        super().__init__(page_table, None, max_pages, None, None, None)
        self.work, self.areas = work, areas
        self.slots, self.granule, self.query = slots, granule, query

    def item(self):
        x, _, _ = cute.arch.block_idx()
        return self.work.planned(x, self.areas.plan.data_ptr())

    def tokens(self):
        _b, _h, _part, _parts, _first, (n, _row), _valid = self.item()
        return n

    def table_row(self):
        _b, _h, _part, _parts, _first, (_n, row), _valid = self.item()
        return row.to(Int64)

    def packed_tokens(self):
        return quantized_tokens(self.tokens(), self.slots.sink, self.slots.window, self.granule)

    def tiles(self) -> TileSpan:
        """The part's packed tiles: whole 128-token steps."""
        _b, _h, part, parts, _first, _facts, _valid = self.item()
        return TileSpan.of_split(self.packed_tokens(), part, parts, STEP_TILES)


@dataclass(frozen=True)
class PlannedHead:
    """The ``foscar.query_rows.KvHead`` of the CTA's planned item (:class:`PlannedSequence`): ``b`` and ``h``
    read from the plan's shared words on each use, so no register holds them across the role dispatch (the
    quotient ``h`` was spilled so); ``kv_heads`` a launch value."""

    work: object  # foscar.work_list.WorkList
    plan: cute.Pointer
    kv_heads: Int32
    row = None

    @property
    def b(self):
        x, _, _ = cute.arch.block_idx()
        b, _h, _part, _parts, _first, _facts, _valid = self.work.planned(x, self.plan)
        return b

    @property
    def h(self):
        x, _, _ = cute.arch.block_idx()
        _b, h, _part, _parts, _first, _facts, _valid = self.work.planned(x, self.plan)
        return h


@dataclass(frozen=True)
class WindowQuery:
    """What the window blocks are attended with (launch values the softmax warpgroup is not given): ``q`` [B, Hq, D],
    ``kv_heads``, and the scale in the log2 domain."""

    q: cute.Pointer
    kv_heads: Int32
    scale_log2: Float32
