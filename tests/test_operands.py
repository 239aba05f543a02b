from fractions import Fraction

import pytest
import torch

from foscar.layouts import TileGeometry, pack_tiles
from foscar.operands import (
    HopperRecipe,
    cancel_word,
    blackwell_int2_nibbles,
    blackwell_int4_e4m3,
    e2m1_value,
    e4m3_value,
    hopper_tile_biases,
    hopper_tile_operands,
)
from foscar.scheme import BLACKWELL_FP4, BLACKWELL_FP8, HOPPER_FP16


@pytest.mark.parametrize("geom", [TileGeometry(r, b, d) for r in "kv" for b in (2, 4, 8) for d in (64, 128, 256)], ids=str)
def test_hopper_recipe_builds_every_operand_exactly(geom, rng):
    """Every operand is its slot's bias + c/2^bits, and that bias is the one bias_slot predicts (the
    kernel's constant fragments): what the MMA sees after the bias MMA is the construction's a*c."""
    codes = torch.randint(0, 2**geom.bits, (64, geom.head_dim), generator=rng, dtype=torch.uint8)
    ops = hopper_tile_operands(pack_tiles(codes, geom), geom)
    assert torch.equal(ops - hopper_tile_biases(geom), HOPPER_FP16[geom.bits].operand(codes))


@pytest.mark.parametrize("geom", [TileGeometry(r, b, 128) for r in "kv" for b in (2, 4, 8)], ids=str)
def test_centred_codes_cancel_exactly(geom, rng):
    """The constant -(bias + centre/2^bits) of every slot is an exact FP16 (cancel_word raises otherwise), and an
    operand minus it is the centred construction's (c - centre)/2^bits, exactly."""
    construction = HOPPER_FP16[geom.bits]
    assert construction.centre == (Fraction(2**geom.bits - 1, 2) if geom.bits < 8 else 128)
    centred = construction.centred()
    for slot in HopperRecipe(geom.bits).slots:
        word = cancel_word(slot.bias, centred.b)
        halves = torch.tensor([word & 0xFFFF, word >> 16], dtype=torch.int32).to(torch.int16).view(torch.float16)
        assert halves.tolist() == [float(centred.b) - slot.bias] * 2  # -(bias + centre/2^bits) in both halves
        assert cancel_word(slot.bias, 0) == slot.magic | 0x80008000  # uncentred: -bias, the power of two negated
    codes = torch.randint(0, 2**geom.bits, (64, geom.head_dim), generator=rng, dtype=torch.uint8)
    ops = hopper_tile_operands(pack_tiles(codes, geom), geom)
    assert torch.equal(ops - (hopper_tile_biases(geom) - float(centred.b)), centred.operand(codes))
    with pytest.raises(ValueError, match="not an exact FP16"):
        cancel_word(4.0, Fraction(-255, 512))  # the 8-bit midpoint at a slot of bias 4


@pytest.mark.parametrize("bits, shifts, biases", [
    (2, [-6, -6, 0, 0, 0, 6, 6, 6], [4, 1, 16, 4, 1, 16, 4, 1]),
    (4, [-6, 0, 6, 6], [1, 4, 16, 1]),
    (8, [0, 6], [4, 1]),
])
def test_hopper_recipe_shifts_a_word_at_most_twice(bits, shifts, biases):
    slots = HopperRecipe(bits).slots
    # the top slots of each half share a shift right by 6, the bottom ones a shift left by 6 (a smaller bias)
    assert [s.shift for s in slots] == shifts
    assert [s.bias for s in slots] == biases and max(biases) <= 16
    # every mask covers one code in each FP16 half, inside the mantissa, clear of the exponent bits
    for s in slots:
        assert bin(s.mask).count("1") == 2 * bits and s.mask & 0xFC00FC00 == 0 and s.magic & s.mask == 0


def test_blackwell_fp4_and_fp8_constructions_are_exact():
    c2, c4 = torch.arange(4), torch.arange(16)
    assert torch.equal(e2m1_value(blackwell_int2_nibbles(c2)), BLACKWELL_FP4.operand(c2))
    assert torch.equal(e4m3_value(blackwell_int4_e4m3(c4)), BLACKWELL_FP8.operand(c4))
