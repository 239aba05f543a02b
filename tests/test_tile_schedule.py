"""How the decode kernels deal out a CTA's tiles, against plain Python (CPU, no compile): the tiles a consumer warp
attends (``foscar.hopper.kernel.warp_steps``), the tiles attended without a mask (``TileSpan.leading_tiles``),
which configurations run the pipelined loop (``foscar.hopper.kernel.pipelines``) and the producer warps' share of
the ring (``foscar.pipeline.first_item``), against a model of its mbarrier protocol."""

import pytest

pytest.importorskip("cutlass")

from foscar import Scheme  # noqa: E402
from foscar.layouts.fragment import TILE_TOKENS  # noqa: E402
from foscar.pipeline import TileSpan  # noqa: E402


def test_each_tile_goes_to_exactly_one_warp():
    """warp_steps: warp w attends the tiles of runs w, w + warps, ...; over the warps, every tile once."""
    from foscar.hopper.kernel import warp_steps

    for run in (1, 2, 4):
        for warps in (1, 4, 8, 12):
            for tiles in range(0, 3 * run * warps + 2):
                counts = [warp_steps(tiles, w, run, warps) for w in range(warps)]
                owners = [(t // run) % warps for t in range(tiles)]
                assert counts == [owners.count(w) for w in range(warps)], (run, warps, tiles)


@pytest.mark.parametrize("min_valid", [1, 16, TILE_TOKENS, TILE_TOKENS + 15])  # + 15: 16 causal query tokens
def test_leading_tiles_are_the_span_tiles_with_enough_tokens(min_valid):
    """TileSpan.leading_tiles: the span's first tiles with at least ``min_valid`` tokens before the sequence's end
    (the rest are masked), for every split of ragged lengths, empty splits included."""
    for length in (1, 15, 16, 63, 64, 65, 127, 128, 700, 4097):
        for num_splits in (1, 2, 3, 5, 16):
            for align in (1, 2):
                for split in range(num_splits):
                    span = TileSpan.of_split(length, split, num_splits, align)
                    valid = [span.valid_tokens(t) for t in range(span.count())]
                    assert all(v >= 1 for v in valid), (length, split, num_splits)
                    leading = next((i for i, v in enumerate(valid) if v < min_valid), len(valid))
                    assert span.leading_tiles(min_valid) == leading, (length, split, num_splits, align)


def test_the_pipelined_loop_runs_where_it_measured_faster():
    """DecodeConfig.PIPELINED (benchmarks/NOTES.md section 37) at the default warpgroups, gqa 4: one query token
    pipelines for INT2 (rings of 4 stages per warp) and not for INT4 (2 stages per warp: the held stage would stall
    the next fill); 16 query columns (4 tokens) never."""
    from foscar.hopper.kernel import DecodeConfig, default_consumers

    def config(bits, k_axis, tokens=1):
        scheme = Scheme.make(bits, k_axis, 128, "token", 128, 128, 4)
        return DecodeConfig(scheme, 128, True, default_consumers(scheme, tokens), tokens=tokens)

    for bits, k_axis in ((2, "token"), (2, "channel"), (4, "token"), (4, "channel")):
        one, four = config(bits, k_axis), config(bits, k_axis, tokens=4)
        assert one.PIPELINED == (bits == 2) == (one.STAGES // one.NW >= 3), (bits, k_axis, one.STAGES, one.NW)
        assert not four.PIPELINED, (bits, k_axis)


def _producer_items(window_tiles, span, sub, producers, count_from_window=True):
    """Each Hopper producer warp's ring items in issue order, walked as the kernel walks them: the cache decode's
    window tiles ``pw, pw + producers, ...`` (``CacheWindow.produce``), then the packed tiles of ``span`` in chunks
    of 32 pages (``HopperDecodeKernel.produce``). ``count_from_window=False``: the packed items dealt out as if the
    ring started at them (the mapping before benchmarks/NOTES.md section 49)."""
    from foscar.pipeline import first_item

    items = [list(range(pw, window_tiles, producers)) for pw in range(producers)]
    ring0 = window_tiles if count_from_window else 0
    page_end = (span.end + sub - 1) // sub
    for chunk in range(span.begin // sub, page_end, 32):
        lo, hi = max(span.begin, chunk * sub), min(span.end, (chunk + 32) * sub)
        for pw in range(producers):
            first = first_item(lo, lo - span.begin + ring0, pw, producers)
            items[pw] += [tile - span.begin + window_tiles for tile in range(first, hi, producers)]
    return items


def _ring_hazard(producer_items, consumer_items, stages, rng):
    """One random interleaving of the ring's warps under mbarrier parity semantics (a wait on parity ``p`` passes
    while the barrier's current phase has the other parity); the first hazard it meets, or None. Hazards: a
    producer overwriting a stage whose item no consumer has released, a consumer reading a stage that holds
    another item, a deadlock."""
    phase = {("full", s): 0 for s in range(stages)} | {("empty", s): 0 for s in range(stages)}
    held = [None] * stages  # the item a stage holds until its consumer releases it
    actors = [("producer", list(i)) for i in producer_items] + [("consumer", list(i)) for i in consumer_items]
    slow = rng.randrange(len(actors))  # one warp lags: the interleavings where a lap is lost
    while any(todo for _, todo in actors):
        ready = []
        for a, (role, todo) in enumerate(actors):
            if todo:
                i = todo[0]
                s, ring_phase = i % stages, (i // stages) % 2
                barrier, parity = (("empty", s), ring_phase ^ 1) if role == "producer" else (("full", s), ring_phase)
                if phase[barrier] % 2 != parity:
                    ready.append(a)
        if not ready:
            return "deadlock"
        lagging = [a for a in ready if a != slow]
        a = rng.choice(lagging if lagging and rng.random() < 0.95 else ready)
        role, todo = actors[a]
        i = todo.pop(0)
        s = i % stages
        if role == "producer":
            if held[s] is not None:
                return f"item {i} overwrote stage {s} while it held item {held[s]}"
            held[s] = i
            phase[("full", s)] += 1
        else:
            if held[s] != i:
                return f"item {i} read stage {s} while it held item {held[s]}"
            held[s] = None
            phase[("empty", s)] += 1
    return None


def _ring_case(window_tiles, run, warps):
    span = TileSpan.of_split(70 * TILE_TOKENS - 5, 0, 1, run)
    n_items = window_tiles + span.count()
    return span, [[i for i in range(n_items) if (i // run) % warps == w] for w in range(warps)]


@pytest.mark.parametrize("window_tiles", [0, 3, 13, 21, 22, 41])
@pytest.mark.parametrize("stages, run, warps", [(8, 1, 8), (12, 1, 4), (16, 2, 8), (24, 1, 8)])
def test_the_ring_loses_no_lap(window_tiles, stages, run, warps):
    """The Hopper cache decode's ring (window tiles, then packed ones) under random interleavings of its 4 producer
    warps and ``warps`` consumer warps (runs of ``run`` tiles each): every item issued once, no stage overwritten
    before its consumer releases it, no consumer reading another item's stage."""
    import random

    from foscar.hopper.kernel import PRODUCER_WARPS

    span, consumers = _ring_case(window_tiles, run, warps)
    producers = _producer_items(window_tiles, span, 2, PRODUCER_WARPS)
    assert sorted(sum(producers, [])) == list(range(window_tiles + span.count()))
    rng = random.Random(window_tiles * 1000 + stages)
    for _ in range(200):
        assert _ring_hazard(producers, consumers, stages, rng) is None


def test_the_ring_check_finds_a_lost_lap():
    """The check above can fail: dealing the packed tiles out afresh after the window's (the kernel before
    benchmarks/NOTES.md section 49) loses a lap with more window tiles than stages, here 21 over 8 stages and 8
    consumer warps (INT4 at head_dim 256 with 2 consumer warpgroups: racecheck and a wrong output on the H200)."""
    import random

    from foscar.hopper.kernel import PRODUCER_WARPS

    span, consumers = _ring_case(21, 1, 8)
    afresh = _producer_items(21, span, 2, PRODUCER_WARPS, count_from_window=False)
    rng = random.Random(21)
    hazards = {_ring_hazard(afresh, consumers, 8, rng) for _ in range(200)} - {None}
    assert any("overwrote" in h for h in hazards), hazards
