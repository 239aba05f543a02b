from fractions import Fraction

import pytest
import torch

from foscar.scheme import BLACKWELL_FP4, BLACKWELL_FP8, HOPPER_FP16, Axis, Construction, Correction, Scheme, Site, TensorQuant


def test_scheme_is_frozen_and_hashable():
    a = Scheme.make(2, k="channel", k_group=128)
    b = Scheme(TensorQuant(Axis.CHANNEL, 128, 2), TensorQuant("token", 128, 2))
    assert a == b and hash(a) == hash(b)
    assert len({a, b, Scheme.make(4)}) == 2
    with pytest.raises(AttributeError):
        a.k = TensorQuant("token", 128, 4)


@pytest.mark.parametrize(
    "k_axis, v_axis, k_site, k_corr, v_site, v_corr",
    [
        ("token", "token", Site.PARTIAL_SUM, Correction.OFFSET_TIMES_QSUM, Site.OTHER_OPERAND, Correction.P_DOT_OFFSET),
        ("channel", "token", Site.OTHER_OPERAND, Correction.Q_DOT_OFFSET, Site.OTHER_OPERAND, Correction.P_DOT_OFFSET),
        ("token", "channel", Site.PARTIAL_SUM, Correction.OFFSET_TIMES_QSUM, Site.PARTIAL_SUM, Correction.OFFSET_TIMES_PSUM),
        ("channel", "channel", Site.OTHER_OPERAND, Correction.Q_DOT_OFFSET, Site.PARTIAL_SUM, Correction.OFFSET_TIMES_PSUM),
    ],
)
def test_plan_places_scales_and_offsets_as_in_design_table(k_axis, v_axis, k_site, k_corr, v_site, v_corr):
    plan = Scheme.make(2, k=k_axis, k_group=64, v=v_axis, v_group=32).plan()
    assert (plan.k.scale_site, plan.k.correction, plan.k.block) == (k_site, k_corr, 64)
    assert (plan.v.scale_site, plan.v.correction, plan.v.block) == (v_site, v_corr, 32)
    for fold in (plan.k, plan.v):  # Hopper centres K channel-wise codes (foscar.folds.KChannelWise.centres_codes)
        centred = (fold.tensor, fold.axis) == ("k", "channel")
        assert fold.construction == (HOPPER_FP16[2].centred() if centred else HOPPER_FP16[2])
        assert fold.offset_shift == (1.5 if centred else 0.0)
    assert Scheme.make(2).plan("sm_100a").construction is BLACKWELL_FP4
    assert Scheme.make(4).plan("sm_90a", construction=BLACKWELL_FP4).construction is BLACKWELL_FP4


def test_k_and_v_bits_are_independent():
    scheme = Scheme.make(k_bits=4, v_bits=2, k="channel", k_group=128)
    assert (scheme.k.bits, scheme.v.bits) == (4, 2) and scheme.name.startswith("k4v2-")
    assert Scheme.make(2, v_bits=4).v.bits == 4 and Scheme.make(2, v_bits=4).k.bits == 2
    assert Scheme.make(4) == Scheme.make(k_bits=4, v_bits=4)
    with pytest.raises(ValueError, match="k.bits / scheme.v.bits"):
        scheme.bits  # no common width
    plan = scheme.plan("sm_100a")
    assert (plan.k.construction, plan.v.construction) == (BLACKWELL_FP8, BLACKWELL_FP4)
    assert (plan.k.tile_code_words, plan.v.tile_code_words) == (64 * 128 * 4 // 32, 64 * 128 * 2 // 32)
    with pytest.raises(ValueError, match="different constructions"):
        plan.construction
    assert scheme.bytes_per_element() == pytest.approx((4 + 2) / 16 + 4 / 128)


@pytest.mark.parametrize("k_axis, k_group, page_size", [("token", 32, 128), ("channel", 32, 128), ("channel", 128, 256)])
def test_params_geometry_of_the_fold_cases(k_axis, k_group, page_size):
    """The params row of a tile, from the fold case, equals the (page, head, row) index of the layout."""
    fold = Scheme.make(2, k=k_axis, k_group=k_group).plan().k
    if k_axis == "token":
        assert (fold.channel_blocks, fold.tile_rows, fold.per_row) == (128 // k_group, 64, 128 // k_group)
        assert fold.params_row(3, 64, page_size) == (3 * page_size + 64) * (128 // k_group)
    else:
        assert (fold.tile_groups, fold.tiles_per_group, fold.per_row) == (max(1, 64 // k_group), max(1, k_group // 64), 128)
        assert fold.params_row(3, 64, page_size) == (3 * (page_size // k_group) + 64 // k_group) * 128


def test_construction_folds_bias_into_offset():
    con = Construction("fp16-1+c/4", "float16", Fraction(1, 4), Fraction(1))  # a biased construction
    s, z, c = 0.3, -1.1, torch.arange(4)
    x = con.fold_scale(s) * con.operand(c) + con.fold_offset(s, z)
    assert torch.allclose(x, s * c.double() + z, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(bits=3), "bits"),
        (dict(bits=True), "bits"),
        (dict(bits=2.0), "bits"),
        (dict(bits=None), "bits"),
        (dict(bits=None, k_bits=4), "bits"),
        (dict(v_bits=3), "v.bits"),
        (dict(k_group=128.0), "k.group"),
        (dict(head_dim=128.0), "head_dim"),
        (dict(head_dim=96), "head_dim"),
        (dict(gqa_ratio=0), "gqa_ratio"),
        (dict(gqa_ratio=2.0), "gqa_ratio"),
        (dict(q_dtype=torch.float32), "q_dtype"),
        (dict(k_group=48), "k.group"),
        (dict(v_group=16), "v.group"),
        (dict(head_dim=64, k_group=128), "k.group"),
        (dict(k="row"), "k axis"),
    ],
)
def test_invalid_schemes_name_the_field(kwargs, field):
    args = dict(bits=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"Scheme.{field}"):
        Scheme.make(**args)


def test_channel_group_may_exceed_head_dim_only_in_the_allowed_set():
    assert Scheme.make(4, k="channel", k_group=128, head_dim=64).k.group == 128
    assert Scheme.make(4, k="channel", k_group=256, head_dim=256).k.group == 256
    with pytest.raises(ValueError, match="Scheme.k.group"):
        Scheme.make(4, k="channel", k_group=256, head_dim=128)


def test_bytes_per_element_matches_the_roofline_table():
    assert Scheme.make(2).bytes_per_element() == pytest.approx(0.28125)
    assert Scheme.make(4, k_group=64, v_group=64).bytes_per_element() == pytest.approx(0.5625)
