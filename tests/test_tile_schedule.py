"""How the decode kernels deal out a CTA's tiles, against plain Python (CPU, no compile): the tiles a consumer warp
attends (``foscar.hopper.kernel.warp_steps``), the tiles attended without a mask (``TileSpan.leading_tiles``) and
which configurations run the pipelined loop (``foscar.hopper.kernel.pipelines``)."""

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
