from fractions import Fraction

import pytest
import torch

from foscar.scheme import BLACKWELL_FP4, HOPPER_FP16, Axis, Construction, Correction, Scheme, Site, TensorQuant


def test_scheme_is_frozen_and_hashable():
    a = Scheme.make(2, k="channel", k_group=128)
    b = Scheme(2, TensorQuant(Axis.CHANNEL, 128), TensorQuant("token", 128))
    assert a == b and hash(a) == hash(b)
    assert len({a, b, Scheme.make(4)}) == 2
    with pytest.raises(AttributeError):
        a.bits = 4


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
    assert plan.construction is HOPPER_FP16[2]
    assert Scheme.make(2).plan(BLACKWELL_FP4).construction is BLACKWELL_FP4


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
