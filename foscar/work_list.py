"""How a decode launch cuts sequences into parts: per call from capacities (:func:`plan_splits`, the
launches without a work list), or balanced over a batch of ragged sequences, planned on the device
(:class:`WorkList`).

Each (sequence, KV head) gets ``parts`` CTAs in proportion to its work: with ``W`` the batch's total
work (all KV heads) and ``budget`` the work list's budget (the host's: the CTAs one wave holds, SMs x CTAs per SM,
or past one wave :func:`wave_budget`'s),

    parts = clamp(floor(work * budget / W), 1, min(max_parts, cap))

(``cap``: the sequence's own limit, e.g. its packed tokens / 256: no part shorter than that; a count just past
``ONE_ROUND_PARTS`` is then cut to it, :func:`one_round_parts`),
so a long sequence next to short ones is cut into as many parts as its share of the GPU, where a
split count fixed per call (:func:`plan_splits`, from capacities) gives each the same.
When ``batch * kv_heads > budget`` (several waves whatever the parts, and the host's cost model keeps one part
per pair at the mean length: :func:`wave_budget`) the share is rounded up instead, so a long sequence's parts do
not outlast the short sequences' CTAs (4 x 32K among 60 x 1K: 1.8 -> 2 parts). The items are numbered sequence
by sequence, KV head by KV head, part by part; their count is at most ``budget + batch * kv_heads`` (each
(sequence, KV head)'s parts are at most its real share + 1, and the shares sum to ``budget``), which is the
launch's grid
(:func:`grid_ctas`): CTAs past the last item exit. For equal lengths this gives about
``plan_splits``'s count: ``plan_splits`` then takes the fewest splits that cut its longest split in whole tiles, the
work list does not (benchmarks/NOTES.md section 41), so the two may differ by that step.

No host sync: CTA ``x`` finds its item by two block-wide passes over the batch (the total, then a
scan of items per sequence), ``threads`` sequences a round, from the same lengths the CTA reads
anyway (a few hundred bytes, in L2 after the first CTAs); the first round's loads serve both passes
and the item's sequence facts come back with it (each dependent load from L2 costs ~0.6 us per
CTA, paid ~8 times per SM at 128 x 8K). The result is a few ints in shared memory.

Both arches' cache decodes plan with :class:`CacheWork` (a sequence's work and cap), so one batch gets one plan
on either; :func:`host_plan` is the plan's CPU mirror (what the tests check the plan with).
"""

from __future__ import annotations

import functools
import math

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from .checks import is_int
from .device import at
from .layouts.fragment import TILE_TOKENS
from .window_tiles import BLOCK, quantized_tokens

__all__ = ["WorkList", "CacheWork", "host_plan", "grid_ctas", "PLAN_WORDS", "plan_splits", "MAX_SPLITS",
           "MAX_DECODE_SPLITS", "WINDOW_MERGE_SPLITS", "MIN_TOKENS_PER_SPLIT", "CTAS_PER_SM", "GROUP",
           "ONE_ROUND_PARTS", "one_round_parts", "wave_budget", "MAX_BUDGET", "CACHE_PART_OVERHEAD_TOKENS"]

MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 128  # the one-launch cache decode's parts (its two-level merge, its counters): NOTES 41
MAX_DECODE_SPLITS = 128  # decode_paged's launches (merged by the combine kernel): 1 x 128K, 1 KV head, NOTES 41
WINDOW_MERGE_SPLITS = 64  # the two-launch cache decode: the window kernel's one CTA merges every split (NOTES 14)
MAX_BUDGET = 1 << 16  # a work list's budget at most (its products with a sequence's work stay within 64 bits)
CTAS_PER_SM = 1  # the Hopper kernel: producer + 3 consumer warpgroups hold an SM's registers (setmaxnreg)
SPLIT_OVERHEAD_TOKENS = 256  # per-CTA prologue, ring fill and combine traffic, in tokens of work
# a cache decode part's: the work list's find, the ring's fill, the partial and its merge, with one CTA per SM and
# nothing beside them (fit to serving steps at 100K-token prefixes, H200: 2.4K-3.9K tokens; benchmarks/NOTES.md 43)
CACHE_PART_OVERHEAD_TOKENS = 3072
GROUP = 8  # consecutive parts one first-level merge takes (foscar.split_merge: one BATCH of loads per thread)
ONE_ROUND_PARTS = 64  # parts whose groups the last merge reads in one round of loads (GROUP x split_merge.BATCH)


def one_round_parts(parts, select=lambda cond, a, b: a if cond else b):
    """``parts``, but a count less than a ``GROUP`` past ``ONE_ROUND_PARTS`` becomes ``ONE_ROUND_PARTS``: the extra
    parts' group would cost the last merge a second round of loads, more than they save (2 KV heads at 1 x 128K:
    66 parts 18.5 us, 64 parts 18.0, benchmarks/NOTES.md section 41; side by side 18.3 -> 18.0, section 42). Only
    this step was measured: 72 to 128 parts also merge in two rounds and keep their count (tp8's 128 parts are
    faster than 64). ``select``: ``cutlass.select_`` on the device, whose ``WorkList`` plans as :func:`host_plan`
    does."""
    just_past = select(parts < ONE_ROUND_PARTS + GROUP, ONE_ROUND_PARTS, parts)
    return select(parts > ONE_ROUND_PARTS, just_past, parts)


def plan_splits(batch: int, kv_heads: int, max_tokens: int, num_sms: int, most: int = MAX_DECODE_SPLITS) -> int:
    """How many CTAs share one (sequence, KV head), flash-decoding style.

    ``CTAS_PER_SM`` CTAs run per SM, so ``n`` splits take ``waves(n) = ceil(batch*kv_heads*n /
    (num_sms*CTAS_PER_SM))`` waves of ``max_tokens/n + SPLIT_OVERHEAD_TOKENS`` tokens each; pick
    the ``n`` with the least total (the fewest splits among equals), at most ``most``, with no split shorter than
    ``MIN_TOKENS_PER_SPLIT`` tokens, then the fewest splits that cut its longest split's whole tiles. Uses the page
    table's capacity, not the lengths, so planning needs no device-to-host sync. (The model counts one CTA per SM;
    an unsplit launch of short sequences may then run two smaller ones per SM: ``foscar.hopper.decode``.)
    """
    for name, value in (("batch", batch), ("kv_heads", kv_heads), ("max_tokens", max_tokens), ("num_sms", num_sms),
                        ("most", most)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return _planned_splits(int(batch), int(kv_heads), int(max_tokens), int(num_sms), int(most))


@functools.lru_cache(maxsize=4096)
def _planned_splits(batch: int, kv_heads: int, max_tokens: int, num_sms: int, most: int,
                    overhead: int = SPLIT_OVERHEAD_TOKENS) -> int:
    """:func:`plan_splits` of checked arguments, kept per shape: a ``decode_paged`` call without ``num_splits``
    plans every time, and the search over up to ``MAX_DECODE_SPLITS`` counts costs ~40 us of Python."""
    slots = num_sms * CTAS_PER_SM
    most = max(1, min(most, max_tokens // MIN_TOKENS_PER_SPLIT))

    def cost(n):
        return math.ceil(batch * kv_heads * n / slots) * (max_tokens / n + overhead)

    best = min(range(1, most + 1), key=lambda n: (cost(n), n))
    # the kernels cut whole tiles, ceil(tiles / n) per split (foscar.pipeline.split_range; rounded up to whole K
    # groups there, which can leave an empty split): the fewest splits with that longest split (66 splits of 2,048
    # tiles are 64 of 32 and two empty CTAs)
    tiles = -(-max_tokens // TILE_TOKENS)
    return -(-tiles // -(-tiles // best))


def wave_budget(budget: int, pairs: int, packed_mean: int) -> int:
    """The budget a work list of ``pairs`` (sequence, KV head) pairs plans with, for waves of ``budget`` CTAs: past
    one wave every pair is one part at least, so the launch's CTAs run in ``ceil(items / budget)`` rounds and
    sequences of equal length leave the last round's SMs idle (serving, 100K-token prefixes: 440 pairs on 132 SMs
    are 3.3 waves of work in 4 rounds). Where :func:`plan_splits`' cost model over sequences of ``packed_mean``
    packed tokens (their mean; 0: not known), with a part's overhead ``CACHE_PART_OVERHEAD_TOKENS``, cuts each pair
    into ``P > 1`` parts, the budget is ``P x pairs + pairs // 2``: the work list's share of a pair, ``floor(its work
    x budget / the total)``, is then its work over the mean's ``P + 1/2`` rounded down, i.e. ``P`` parts per mean's
    worth rounded to the nearest count (``P`` each at equal lengths, and at lengths a little under the mean; at
    least 1); the items stay within ``grid_ctas`` of that budget. Else ``budget`` as given."""
    if pairs <= budget or packed_mean < 1:
        return budget
    parts = _planned_splits(pairs, 1, packed_mean, budget, MAX_SPLITS, CACHE_PART_OVERHEAD_TOKENS)
    return budget if parts == 1 else min(pairs * parts + pairs // 2, MAX_BUDGET)


ITEM_FIELDS = 6  # b, part, parts, first item of the sequence, the sequence's two payload words
PLAN_WORDS = 32 + ITEM_FIELDS  # shared Int32 words: one per warp (<= 32), then the item


def grid_ctas(budget: int, batch: int, kv_heads: int) -> int:
    """The launch's CTAs: an upper bound on the items (see the module docstring)."""
    return budget + batch * kv_heads


class WorkList:
    """Device side: ``find`` for the CTA's ``threads`` threads. ``max_parts``: a (sequence, KV head)'s
    most parts (its partials are merged by one CTA)."""

    def __init__(self, threads: int, max_parts: int):
        self.threads, self.warps = threads, threads // 32
        self.max_parts = max_parts

    @cute.jit
    def block_scan(self, value: Int32, scratch: cute.Tensor, tidx: Int32):
        """(exclusive prefix of ``value`` over the block's threads, block total); two CTA barriers."""
        lane, warp = tidx % 32, tidx // 32
        incl = value
        for offset in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(incl, offset=1 << offset)
            incl = incl + cutlass.select_(lane >= (1 << offset), up, Int32(0))
        if lane == 31:
            scratch[warp] = incl
        cute.arch.sync_threads()
        before, total = Int32(0), Int32(0)
        for w in cutlass.range_constexpr(self.warps):
            before = before + cutlass.select_(Int32(w) < warp, scratch[w], Int32(0))
            total = total + scratch[w]
        cute.arch.sync_threads()  # scratch free again
        return before + incl - value, total

    @cute.jit
    def record(self, scratch: cute.Tensor, item: int, x: Int32, b: Int32, parts: Int32, first: Int32, fact0: Int32,
               fact1: Int32):
        """Item ``x`` is of sequence ``b`` (-1: none), whose items start at ``first``, ``parts`` per KV head."""
        scratch[item] = b
        scratch[item + 1] = (x - first) % parts
        scratch[item + 2] = parts
        scratch[item + 3] = first
        scratch[item + 4] = fact0
        scratch[item + 5] = fact1

    @cute.jit
    def plan_batch(self, x: Int32, batch: Int32, kv_heads: Int32, budget: Int32, work_of, first_round,
                   scratch: cute.Tensor, item: int, tidx: Int32):
        """``find`` over a batch: the total work, then the scan of items per sequence; the thread of
        ``x``'s sequence records it."""
        total = Int32(0)
        for c in cutlass.range(0, batch, self.threads, unroll=1):
            b = c + tidx
            work, cap, fact0, fact1 = first_round
            if c > 0:
                work, cap, fact0, fact1 = work_of(cutlass.min(b, batch - 1))
            _, chunk = self.block_scan(cutlass.select_(b < batch, work, Int32(0)), scratch, tidx)
            total = total + chunk
        if tidx == 0:
            scratch[item] = Int32(-1)  # no item: x past the last
        base = Int32(0)  # items before this round's sequences
        for c in cutlass.range(0, batch, self.threads, unroll=1):
            b = c + tidx
            work, cap, fact0, fact1 = first_round
            if c > 0:
                work, cap, fact0, fact1 = work_of(cutlass.min(b, batch - 1))
            num, den = work.to(Int64) * budget.to(Int64), kv_heads.to(Int64) * total.to(Int64)
            # rounded down while the items fit in about one wave; else up (several waves whatever the
            # rounding: a long sequence's parts should not outlast the short sequences' CTAs)
            share = Int32(cutlass.select_(batch * kv_heads > budget, (num + den - 1) // den, num // den))
            parts = one_round_parts(cutlass.max(cutlass.min(cutlass.min(share, cap), self.max_parts), 1),
                                    cutlass.select_)
            items = cutlass.select_(b < batch, kv_heads * parts, Int32(0))
            before, chunk = self.block_scan(items, scratch, tidx)
            first = base + before
            if first <= x and x < first + items:
                self.record(scratch, item, x, b, parts, first, fact0, fact1)
            base = base + chunk

    @cute.jit
    def find(self, x: Int32, batch: Int32, kv_heads: Int32, budget: Int32, work_of, scratch_ptr: cute.Pointer,
             tidx: Int32):
        """CTA ``x``'s item: ``(b, h, part, parts, first, facts, valid)``: sequence ``b``, KV head ``h``,
        part ``part`` of ``parts``; ``first``: the item number of the (sequence, KV head)'s part 0;
        ``facts``: the sequence's two payload words; ``valid``: whether ``x`` is an item.
        ``work_of(b)``: sequence ``b``'s ``(work, cap, payload, payload)`` (Int32, work > 0, cap >= 1)."""
        scratch = cute.make_tensor(scratch_ptr, cute.make_layout((PLAN_WORDS,)))
        item = 32  # scratch[item:]: b, part, parts, first, payloads
        first_round = work_of(cutlass.min(tidx, batch - 1))  # kept: B <= threads loads once
        if batch == 1:  # one sequence: its share is budget / kv_heads, no scan
            if tidx == 0:
                _work, cap, fact0, fact1 = first_round
                parts = one_round_parts(cutlass.max(cutlass.min(cutlass.min(budget // kv_heads, cap), self.max_parts),
                                                    1), cutlass.select_)
                self.record(scratch, item, x, cutlass.select_(x < kv_heads * parts, Int32(0), Int32(-1)), parts,
                            Int32(0), fact0, fact1)
        else:
            self.plan_batch(x, batch, kv_heads, budget, work_of, first_round, scratch, item, tidx)
        cute.arch.sync_threads()
        return self.planned(x, scratch_ptr)

    @cute.jit
    def planned(self, x: Int32, scratch_ptr: cute.Pointer):
        """CTA ``x``'s item as :meth:`find` left it in ``scratch_ptr`` (read again where a kernel keeps no
        register across a role dispatch); the same tuple as :meth:`find`."""
        scratch = cute.make_tensor(scratch_ptr, cute.make_layout((PLAN_WORDS,)))
        item = 32
        b, part, parts, first = scratch[item], scratch[item + 1], scratch[item + 2], scratch[item + 3]
        valid = b >= 0
        h = cutlass.select_(valid, (x - first) // cutlass.max(parts, 1), Int32(0))
        return cutlass.max(b, 0), h, part, parts, first + h * parts, (scratch[item + 4], scratch[item + 5]), valid


class CacheWork:
    """The work of a ``foscar.cache.PagedKVCache`` sequence, :meth:`WorkList.find`'s ``work_of`` for both
    arches' cache decodes (``foscar.hopper.cache_decode``, ``foscar.blackwell.cache_decode``), so one batch
    gets one plan on either: its packed tiles' bytes (``tile_bytes`` each: codes and params) and its window
    blocks' (16 slots of 16-bit K and V rows of ``head_dim``), in 256-byte units; its cap: one part per
    ``MIN_TOKENS_PER_SPLIT`` packed tokens (``granule``: the cache's quantization granule)."""

    def __init__(self, tile_bytes: int, head_dim: int, granule: int):
        self.tile_units = max(1, tile_bytes // 256)
        self.block_units = BLOCK * 4 * head_dim // 256
        self.tiles_per_part = MIN_TOKENS_PER_SPLIT // TILE_TOKENS
        self.granule = granule

    def window_units(self, sink, ring):
        """The window blocks' work, the same for every sequence: all ``sink + ring`` slots are read."""
        return (sink + ring + BLOCK - 1) // BLOCK * self.block_units

    @cute.jit
    def sequence(self, seq_rows: cute.Pointer, seq_lengths: cute.Pointer, b: Int32, sink: Int32, window: Int32,
                 win_units: Int32):
        """Sequence ``b``'s ``(work, cap, tokens, row)`` (``win_units``: :meth:`window_units`)."""
        row = at(seq_rows, b)
        n = Int32(at(seq_lengths, row))
        tiles = (quantized_tokens(n, sink, window, self.granule) + TILE_TOKENS - 1) // TILE_TOKENS
        return tiles * self.tile_units + win_units, cutlass.max(tiles // self.tiles_per_part, 1), n, Int32(row)

    def host_sequence(self, n: int, sink: int, window: int, ring: int) -> tuple[int, int]:
        """``(work, cap)`` of an ``n``-token sequence, on the host (what :meth:`sequence` computes)."""
        packed = max(n - sink - window, 0) // self.granule * self.granule
        tiles = -(-packed // TILE_TOKENS)
        work = tiles * self.tile_units + -(-(sink + ring) // BLOCK) * self.block_units
        return work, max(tiles // self.tiles_per_part, 1)


def host_plan(works, caps, kv_heads: int, budget: int, max_parts: int = MAX_SPLITS) -> list[tuple[int, int, int, int]]:
    """The items :meth:`WorkList.find` gives CTAs ``0, 1, ...`` for sequences of ``works`` and ``caps``
    (:meth:`CacheWork.host_sequence`), on the host: ``(b, h, part, parts)`` each, in item order (the CPU
    reference of the device plan)."""
    batch, total = len(works), sum(works)
    items = []
    for b, (work, cap) in enumerate(zip(works, caps)):
        if batch == 1:
            share = budget // kv_heads
        else:
            num, den = work * budget, kv_heads * total
            share = -(-num // den) if batch * kv_heads > budget else num // den
        parts = one_round_parts(max(min(share, cap, max_parts), 1))
        items += [(b, h, part, parts) for h in range(kv_heads) for part in range(parts)]
    return items
