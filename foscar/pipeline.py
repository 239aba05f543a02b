"""The shared-memory ring of the decode kernels (Hopper and Blackwell): 1-D bulk copies (TMA
engine) into stages guarded by mbarriers.

Every (page, kv_head, 64-token tile) block of packed codes is contiguous in global memory, and so
are the tile's (scale, offset) rows, so a stage is filled by four plain ``cp.async.bulk`` copies
(no tensor map): K codes, V codes, K params, V params. A producer warp walks the tiles and one lane of it,
chosen by ``elect.sync``, issues them (Hopper: 4 producer warps, every 4th tile each; Blackwell: one warp).

Barriers of stage ``s`` (``full[s]``, ``empty[s]``):

* ``full[s]``: arrival count 1. The producer arrives with ``expect_tx(stage bytes)``; the copies
  complete the transaction bytes. Consumers wait on its phase parity. (Hopper's cache decode, whose
  stages may instead hold a 16-bit window tile copied by 32 lanes' ``cp.async``, counts 32 arrivals:
  each lane's ``cp.async.mbarrier.arrive.noinc``, or a packed tile's producer arriving for all 32;
  ``foscar.hopper.cache_decode``.)
* ``empty[s]``: arrival count = the threads that read stage ``s`` (Hopper: the one warp that owns
  the tile; Blackwell: the two warpgroups that read it). Each arrives after its last shared-memory
  read; the producer waits before overwriting the stage. A fresh barrier counts as completed for
  parity 1, so the producer's first pass over the ring waits on ``phase ^ 1`` and does not block.

Why not the DSL's ``cutlass.pipeline.PipelineTmaAsync``: the Hopper cache decode's ring holds 16-bit window
tiles between the packed ones, whose fill is 32 lanes' ``cp.async`` arrivals and no transaction bytes, where the
library class has one producer arrival and one ``tx_count`` per pipeline; and on the plain decode's ring (where it
fits) it measured no better: consumer main loop 720 / 931 / 755 SASS instructions per tile against this module's
717 / 930 / 754 (INT2 K token-wise, INT2 K channel-wise, INT4; its release is one signalling lane per warp behind a
predicate), producer loop 161 against 163 (2026-12-03, sm_90a, benchmarks/NOTES.md section 33). One ring for
both kernels, then.

Local tile ``i`` of a CTA uses stage ``i % stages`` in phase ``(i // stages) % 2``. A consumer must
never wait on a stage two phases ahead of its fill (the parity would read as complete): the Hopper
kernel makes every stage belong to one consumer warp, which waits on it right after its own
previous use. The producers, likewise: ring item ``i`` comes from producer warp ``i % 4``, whatever
fills it (a window tile or a packed one, :func:`first_item`), and ``stages`` is a multiple of 4, so
one warp fills a stage, in order, and waits on its ``empty`` right after its own previous fill. (The
cache decode's packed tiles once started that count afresh after the window's: with more window tiles
than stages, a warp could wait one lap early and overwrite a stage a consumer still read; racecheck on
the H200, benchmarks/NOTES.md section 49.)
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cutlass_dsl import dsl_user_op

from .device import divmod_nonnegative, inline_ptx
from .layouts.fragment import TILE_TOKENS


@dsl_user_op
def bulk_copy_g2s(dst: cute.Pointer, src: cute.Pointer, nbytes: int, mbar: cute.Pointer, *, loc=None, ip=None):
    """``cp.async.bulk`` of ``nbytes`` (multiple of 16) from global ``src`` to shared ``dst``,
    completing its bytes on the mbarrier ``mbar``. Issue from one thread."""
    inline_ptx(None, [dst.toint(loc=loc, ip=ip), src.toint(loc=loc, ip=ip), Int32(nbytes), mbar.toint(loc=loc, ip=ip)],
               "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
               "r,l,r,r,~{memory}", True, loc, ip)


def first_item(lo, item_of_lo, producer, producers: int):
    """The first index ``>= lo`` that producer ``producer`` of ``producers`` issues, where index ``lo`` is ring item
    ``item_of_lo`` (>= 0) and ring item ``i`` is producer ``i % producers``'s (the module docstring says why)."""
    return lo + divmod_nonnegative(producer + producers - divmod_nonnegative(item_of_lo, producers)[1], producers)[1]


def stage(i, stages: int):
    """The stage of item ``i`` (>= 0) in a ring of ``stages``."""
    return divmod_nonnegative(i, stages)[1]


def phase(i, stages: int):
    """The phase parity of item ``i`` (>= 0) in a ring of ``stages``."""
    return divmod_nonnegative(i, stages)[0] & 1


# The bundles below are frozen dataclasses: the DSL treats them as read-only, so a kernel may call their
# methods inside runtime loops and branches (other Python objects would have to be loop-carried values;
# docs/design.md section 3).
@dataclass(frozen=True)
class Channel:
    """``stages`` (full, empty) mbarrier pairs from ``base``: full[s] = base + s, empty[s] = base + stages + s.
    Item ``i`` (a tile, a step) uses stage ``i % stages`` in phase parity ``(i // stages) % 2``; the producer
    waits ``empty`` on the opposite parity (a fresh mbarrier counts as completed for parity 1, so the first
    pass does not block). Both arches' rings and Blackwell's warpgroup handoffs are channels."""

    base: cute.Pointer
    stages: int

    def next(self, stages: int) -> Channel:
        """The channel of ``stages`` pairs right after this one."""
        return Channel(self.base + 2 * self.stages, stages)

    def init(self, full_count: int, empty_count: int):
        """Call from one thread (then mbarrier_init_fence + a CTA barrier)."""
        for s in range(self.stages):
            cute.arch.mbarrier_init(self.base + s, full_count)
            cute.arch.mbarrier_init(self.base + self.stages + s, empty_count)

    def stage(self, i):
        return stage(i, self.stages)

    def full(self, s):
        return self.base + s

    def empty(self, s):
        return self.base + self.stages + s

    def wait_full(self, i):
        """Consumer: item i is in its stage."""
        cute.arch.mbarrier_wait(self.base + stage(i, self.stages), phase(i, self.stages))

    def release(self, i):
        """Consumer: done with item i's stage (one arrival per thread)."""
        cute.arch.mbarrier_arrive(self.base + self.stages + stage(i, self.stages))

    def wait_empty(self, i):
        """Producer: item i - stages has been released (passes at once on the first pass)."""
        cute.arch.mbarrier_wait(self.base + self.stages + stage(i, self.stages), phase(i, self.stages) ^ 1)

    def publish(self, i):
        """Producer: item i is written (one arrival per thread)."""
        cute.arch.mbarrier_arrive(self.base + stage(i, self.stages))


@dataclass(frozen=True)
class Ring:
    """A CTA's ring in shared memory (Hopper's): ``barriers.stages`` stages of ``stage_words`` int32 words from
    ``words``, stage ``s`` guarded by the channel's ``full(s)`` and ``empty(s)`` (see the module docstring)."""

    words: cute.Pointer
    barriers: Channel
    stage_words: int

    @property
    def stages(self) -> int:
        return self.barriers.stages

    def position(self, i):
        """(stage, phase parity) of local tile ``i``."""
        return stage(i, self.stages), phase(i, self.stages)

    def stage(self, s):
        """The first word of stage ``s``."""
        return self.words + cute.assume(s * self.stage_words, divby=4)

    def wait_full(self, s, parity):
        """Consumer: stage ``s`` is filled in phase ``parity``."""
        cute.arch.mbarrier_wait(self.barriers.full(s), parity)

    def wait_empty(self, s, parity):
        """Producer: stage ``s``'s previous fill is read (passes at once on the first pass)."""
        cute.arch.mbarrier_wait(self.barriers.empty(s), parity ^ 1)

    def release(self, s):
        """Consumer: done with stage ``s`` (one arrival per thread)."""
        cute.arch.mbarrier_arrive(self.barriers.empty(s))


@dataclass(frozen=True)
class PackedPages:
    """One layer's packed K and V pages, the producers' source: int32 codes ``[pages, kv_heads, tiles per
    page, tile words]``, fp16 (scale, offset) params in the fold case's layout, and the page table (int32
    ``[rows, max_pages]``) of each sequence's row."""

    k_codes: cute.Pointer
    k_params: cute.Pointer
    v_codes: cute.Pointer
    v_params: cute.Pointer
    page_table: cute.Pointer
    max_pages: Int32


@dataclass(frozen=True)
class TileSpan:
    """A CTA's 64-token tiles ``begin .. end - 1`` of a sequence of ``length`` tokens (empty: begin >= end)."""

    length: Int32
    begin: Int32
    end: Int32

    @staticmethod
    def of_split(length, split, num_splits, align: int) -> TileSpan:
        """Split ``split``'s tiles (:func:`split_range`)."""
        _n_tiles, begin, end = split_range(length, split, num_splits, align)
        return TileSpan(length, begin, end)

    def count(self):
        return cutlass.max(self.end - self.begin, 0)

    def n_tiles(self):
        """The sequence's 64-token tiles (all splits')."""
        return (self.length + TILE_TOKENS - 1) // TILE_TOKENS

    def steps(self, tiles_per_step: int):
        """The span's steps of ``tiles_per_step`` tiles (Blackwell: 128-token steps; <= 0 when empty)."""
        return (self.end - self.begin + tiles_per_step - 1) // tiles_per_step

    def valid_tokens(self, local_tile):
        """Tokens of local tile ``local_tile`` before the sequence's end (>= 1 for the span's tiles)."""
        return self.length - (self.begin + local_tile) * TILE_TOKENS

    def leading_tiles(self, min_valid: int):
        """How many of the span's first tiles have at least ``min_valid`` tokens before the sequence's end (the
        ones a kernel may attend without a mask)."""
        fitting = cutlass.max(self.length + TILE_TOKENS - min_valid, 0) // TILE_TOKENS - self.begin
        return cutlass.min(cutlass.max(fitting, 0), self.count())


def split_range(length, split, num_splits, align: int):
    """(n_tiles, t_begin, t_end) of split ``split``: the sequence's ``n_tiles`` 64-token tiles cut into
    ``num_splits`` ranges of whole runs of ``align`` tiles (a channel-wise K group, a Blackwell
    128-token step), so no run straddles two CTAs. The last splits may be empty (t_begin >= t_end).
    ``align`` is a power of two: rounding up is then one add and one AND."""
    if align & (align - 1):
        raise ValueError(f"align must be a power of two, got {align}")
    n_tiles = (length + TILE_TOKENS - 1) // TILE_TOKENS
    per_split = ((n_tiles + num_splits - 1) // num_splits + align - 1) & -align
    t_begin = split * per_split
    return n_tiles, t_begin, cutlass.min(t_begin + per_split, n_tiles)
