import pytest
import torch

from foscar.layouts import TileGeometry, pack_tiles
from foscar.operands import (
    HopperRecipe,
    blackwell_int2_nibbles,
    blackwell_int4_e4m3,
    e2m1_value,
    e4m3_value,
    hopper_tile_operands,
)
from foscar.scheme import BLACKWELL_FP4, BLACKWELL_FP8, HOPPER_FP16


@pytest.mark.parametrize("geom", [TileGeometry(r, b, d) for r in "kv" for b in (2, 4) for d in (64, 128, 256)], ids=str)
def test_hopper_recipe_builds_every_operand_exactly(geom, rng):
    codes = torch.randint(0, 2**geom.bits, (64, geom.head_dim), generator=rng, dtype=torch.uint8)
    ops = hopper_tile_operands(pack_tiles(codes, geom), geom)
    assert torch.equal(ops, HOPPER_FP16[geom.bits].operand(codes))


@pytest.mark.parametrize("bits", [2, 4])
def test_hopper_recipe_is_one_shift_and_one_lop3_per_register(bits):
    recipe = HopperRecipe(bits)
    # every slot's codes land in the top `bits` mantissa bits: shifts stay within one word
    shifts = [recipe.right_shift(k) for k in range(16 // bits)]
    assert all(-10 < s < 16 for s in shifts)
    assert recipe.mask == {2: 0x03000300, 4: 0x03C003C0}[bits]


def test_blackwell_fp4_and_fp8_constructions_are_exact():
    c2, c4 = torch.arange(4), torch.arange(16)
    assert torch.equal(e2m1_value(blackwell_int2_nibbles(c2)), BLACKWELL_FP4.operand(c2))
    assert torch.equal(e4m3_value(blackwell_int4_e4m3(c4)), BLACKWELL_FP8.operand(c4))
