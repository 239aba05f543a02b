"""The CuTe layouts of foscar.layouts.cute equal the explicit formula fragment.tile_position.

The layouts are evaluated by CuTe itself at trace time (static coordinates give Python ints), so
the test runs on a CPU machine. A CuTe layout's index is the sum of its top-level modes' indices,
so evaluating CuTe on every token (channel 0) and every channel (token 0) determines it on every
(token, channel); a random sample of full 2-D coordinates is also evaluated directly, which checks
that additivity instead of assuming it. That keeps the exhaustive check to about a second.
"""

import random

import cutlass.cute as cute
import pytest

from foscar.layouts.cute import bit_layout, code_layout
from foscar.layouts.fragment import TILE_TOKENS, TileGeometry, tile_position

GEOMETRIES = [TileGeometry(role, bits, d) for role in ("k", "v") for bits in (2, 4) for d in (64, 128, 256)]
SAMPLES = 64


def _evaluate(geom):
    """CuTe's values: per-token and per-channel columns, a 2-D sample, and bit-layout samples."""
    rng = random.Random(f"{geom.role}{geom.bits}{geom.head_dim}")
    pairs = [(rng.randrange(TILE_TOKENS), rng.randrange(geom.head_dim)) for _ in range(SAMPLES)]
    out = {}

    @cute.jit
    def probe():
        layout = code_layout(geom)
        bits = bit_layout(geom)
        out["size"] = cute.size(layout)
        out["tokens"] = [cute.crd2idx((t, 0), layout) for t in range(TILE_TOKENS)]
        out["channels"] = [cute.crd2idx((0, c), layout) for c in range(geom.head_dim)]
        out["pairs"] = [cute.crd2idx(p, layout) for p in pairs]
        out["bits"] = [cute.crd2idx(p, bits) for p in pairs]

    cute.compile(probe)
    return pairs, out


@pytest.mark.parametrize("geom", GEOMETRIES, ids=lambda g: f"{g.role}{g.bits}d{g.head_dim}")
def test_cute_layout_matches_tile_position(geom):
    pairs, out = _evaluate(geom)
    assert out["size"] == TILE_TOKENS * geom.head_dim
    assert all(isinstance(v, int) for v in out["tokens"] + out["channels"] + out["pairs"])
    for t in range(TILE_TOKENS):
        row = out["tokens"][t]
        for c in range(geom.head_dim):
            assert row + out["channels"][c] == tile_position(geom, t, c), (t, c)
    for (t, c), q, b in zip(pairs, out["pairs"], out["bits"]):
        assert q == tile_position(geom, t, c) and b == q * geom.bits, (t, c)
