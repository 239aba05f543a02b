import pytest
import torch

from foscar.layouts import TileGeometry, evaluate_layout, pack_tiles, tile_layout, tile_position, unpack_tiles

GEOMETRIES = [TileGeometry(r, b, d) for r in "kv" for b in (2, 4, 8) for d in (64, 128, 256)]


@pytest.mark.parametrize("geom", GEOMETRIES, ids=str)
def test_tile_position_is_a_bijection_and_equals_the_cute_style_layout(geom):
    shape, stride = tile_layout(geom)
    seen = set()
    for token in range(64):
        for channel in range(geom.head_dim):
            q = tile_position(geom, token, channel)
            assert evaluate_layout(shape, stride, (token, channel)) == q
            seen.add(q)
    assert seen == set(range(64 * geom.head_dim))


@pytest.mark.parametrize("geom", GEOMETRIES, ids=str)
def test_pack_unpack_round_trip_and_bit_positions(geom, rng):
    codes = torch.randint(0, 2**geom.bits, (3, 64, geom.head_dim), generator=rng, dtype=torch.uint8)
    words = pack_tiles(codes, geom)
    assert words.dtype == torch.int32 and words.shape == (3, geom.words)
    assert torch.equal(unpack_tiles(words, geom), codes)
    # spot-check the documented rule: code q sits in word q // cpw at bit (q % cpw) * bits
    u = words.to(torch.int64) & 0xFFFFFFFF
    for token, channel in [(0, 0), (63, geom.head_dim - 1), (17, 5), (40, geom.head_dim // 2 + 3)]:
        q = tile_position(geom, token, channel)
        got = (u[1, q // geom.codes_per_word] >> ((q % geom.codes_per_word) * geom.bits)) & (2**geom.bits - 1)
        assert int(got) == int(codes[1, token, channel])


def test_a_thread_reads_contiguous_16_byte_vectors():
    geom = TileGeometry("k", 2, 128)
    # thread 0's register 0 lives in word 0; thread 1's in word vector_words: 16 bytes apart
    assert tile_position(geom, 0, 0) // geom.codes_per_word == 0
    assert tile_position(geom, 0, 2) // geom.codes_per_word == geom.vector_words == 4


def test_bad_geometry_names_the_argument():
    with pytest.raises(ValueError, match="role"):
        TileGeometry("q", 2, 128)
    with pytest.raises(ValueError, match="bits"):
        TileGeometry("k", 3, 128)
    with pytest.raises(ValueError, match="head_dim"):
        TileGeometry("k", 2, 96)
    with pytest.raises(ValueError, match="codes must end"):
        pack_tiles(torch.zeros(64, 64, dtype=torch.uint8), TileGeometry("k", 2, 128))
