import pytest
import torch

from foscar.quantize import dequantize_groups, quantize_groups, quantize_kv
from foscar.scheme import Axis, Scheme, TensorQuant


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("quant", [(Axis.TOKEN, 32), (Axis.TOKEN, 128), (Axis.CHANNEL, 64)])
def test_round_trip_error_is_at_most_half_a_step(bits, quant, rng):
    quant = TensorQuant(*quant, bits)
    x = torch.randn(2, 128, 128, generator=rng) * 3 + 0.5
    codes, scale, offset = quantize_groups(x, quant)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 2**bits - 1
    assert scale.dtype == offset.dtype == torch.float16
    err = (dequantize_groups(codes, scale, offset, quant, torch.float64) - x.double()).abs()
    step = dequantize_groups(torch.ones_like(codes), scale, torch.zeros_like(offset), quant, torch.float64)
    # half a step, plus the fp16 rounding of scale and offset (relative 2^-11 of the range)
    assert (err <= step / 2 + 2e-3 * (x.abs().max() + 1)).all()


def test_constant_group_has_zero_scale_and_exact_values():
    x = torch.full((64, 128), 0.75)
    codes, scale, offset = quantize_groups(x, TensorQuant(Axis.TOKEN, 128, 2))
    assert (scale == 0).all() and (codes == 0).all() and (offset == 0.75).all()


def test_invalid_tokens_do_not_enter_channel_group_statistics(rng):
    x = torch.randn(1, 64, 64, generator=rng)
    x[:, 40:] = 1000.0  # padding garbage past the length
    valid = torch.arange(64)[None] < 40
    codes, scale, offset = quantize_groups(x, TensorQuant(Axis.CHANNEL, 64, 4), valid)
    assert float(scale.float().max()) < 1.0 and (codes[:, 40:] == 0).all()


@pytest.mark.parametrize("scheme", [Scheme.make(4, head_dim=64), Scheme.make(2, k="channel", k_group=64, head_dim=64)],
                         ids=lambda s: s.name)
def test_padding_is_ignored_even_when_it_is_nan(scheme, rng):
    """A padded batch's padding (tokens past a sequence's length) is not the sequence's: nan or inf there is
    quantized as zeros would be (code 0, outside every group's statistics), never refused; in a valid token it is."""
    k, v = (torch.randn(2, 2, 100, 64, generator=rng).bfloat16() for _ in range(2))
    lengths = torch.tensor([100, 30])
    padded = {}
    for name, fill in (("zeros", 0.0), ("nan", float("nan")), ("inf", float("inf"))):
        k[1, :, 30:], v[1, :, 30:] = fill, -fill
        padded[name] = quantize_kv(k, v, scheme, lengths=lengths)
    for name in ("nan", "inf"):
        for field in ("k_codes", "k_params", "v_codes", "v_params"):
            assert torch.equal(getattr(padded[name], field), getattr(padded["zeros"], field)), (name, field)
    assert all(torch.isfinite(x).all() for x in padded["nan"].dequantize())
    k[1, :, 29] = float("nan")
    with pytest.raises(ValueError, match="^k holds inf or nan"):
        quantize_kv(k, v, scheme, lengths=lengths)


@pytest.mark.parametrize(
    "scheme, page_size",
    [
        (Scheme.make(2, head_dim=128, gqa_ratio=4), 64),
        (Scheme.make(4, k="channel", k_group=32, v="channel", v_group=128, head_dim=64), 128),
        (Scheme.make(2, k="channel", k_group=128, v_group=32, head_dim=256), 256),
        (Scheme.make(k="channel", k_group=64, v_group=32, k_bits=4, v_bits=2), 128),
        (Scheme.make(v="channel", v_group=64, head_dim=64, k_bits=2, v_bits=4), 64),
    ],
    ids=lambda p: getattr(p, "name", str(p)),
)
@pytest.mark.parametrize("layout", ["hopper", "blackwell"])
def test_paged_cache_round_trip_with_ragged_lengths_and_shuffled_pages(scheme, page_size, layout, rng):
    batch, heads, tokens, dim = 3, 2, 2 * page_size + 1, scheme.head_dim
    k = torch.randn(batch, heads, tokens, dim, generator=rng).to(scheme.q_dtype)
    v = torch.randn(batch, heads, tokens, dim, generator=rng).to(scheme.q_dtype)
    lengths = torch.tensor([tokens, 1, page_size + 1], dtype=torch.int32)
    cache = quantize_kv(k, v, scheme, page_size, lengths, layout=layout)
    assert cache.layout == layout
    max_pages = 3
    for codes, quant in ((cache.k_codes, scheme.k), (cache.v_codes, scheme.v)):
        assert codes.shape == (batch * max_pages, heads, page_size // 64, 64 * dim * quant.bits // 32)
    assert cache.page_table.shape == (batch, max_pages)
    shuffled = cache.shuffle_pages(rng)
    assert not torch.equal(shuffled.page_table, cache.page_table)
    for a, b in zip(cache.dequantize(torch.float64), shuffled.dequantize(torch.float64)):
        assert torch.equal(a, b)
    kd, vd = cache.dequantize(torch.float64)
    for bi, n in enumerate(lengths.tolist()):
        assert (kd[bi, :, n:] == 0).all()
        for x, xd in ((k, kd), (v, vd)):
            assert (xd[bi, :, :n] - x[bi, :, :n].double()).abs().max() < 2.5  # well under a 2-bit step of N(0,1) groups
    assert cache.nbytes() > 0


@pytest.mark.parametrize("k_axis, v_axis", [("token", "token"), ("channel", "token"), ("token", "channel"),
                                            ("channel", "channel")])
@pytest.mark.parametrize("k_bits, v_bits", [(4, 2), (2, 4)])
@pytest.mark.parametrize("layout", ["hopper", "blackwell"])
def test_mixed_widths_pack_each_tensor_as_its_uniform_scheme_does(k_axis, v_axis, k_bits, v_bits, layout, rng):
    """K of a K4V2 cache is, word for word, K of the INT4 cache of the same data; V that of the INT2 one."""
    kw = dict(k=k_axis, k_group=64, v=v_axis, v_group=32, head_dim=128)
    mixed = Scheme.make(k_bits=k_bits, v_bits=v_bits, **kw)
    k = torch.randn(2, 2, 200, 128, generator=rng).bfloat16()
    v = torch.randn(2, 2, 200, 128, generator=rng).bfloat16()
    lengths = torch.tensor([200, 77], dtype=torch.int32)
    cache = quantize_kv(k, v, mixed, 128, lengths, layout=layout)
    k_only = quantize_kv(k, v, Scheme.make(k_bits, **kw), 128, lengths, layout=layout)
    v_only = quantize_kv(k, v, Scheme.make(v_bits, **kw), 128, lengths, layout=layout)
    assert cache.k_codes.shape[-1] == 64 * 128 * k_bits // 32 and cache.v_codes.shape[-1] == 64 * 128 * v_bits // 32
    assert torch.equal(cache.k_codes, k_only.k_codes) and torch.equal(cache.k_params, k_only.k_params)
    assert torch.equal(cache.v_codes, v_only.v_codes) and torch.equal(cache.v_params, v_only.v_params)
    kd, vd = cache.dequantize(torch.float64)
    assert torch.equal(kd, k_only.dequantize(torch.float64)[0]) and torch.equal(vd, v_only.dequantize(torch.float64)[1])


def test_quantize_kv_rejects_bad_input():
    s = Scheme.make(2)
    good = torch.randn(1, 1, 64, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="k must have dtype"):
        quantize_kv(good.float(), good, s)
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        quantize_kv([1], good, s)
    with pytest.raises(ValueError, match="v must have shape"):
        quantize_kv(good, good[..., :64], s)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        quantize_kv(good, good[:, :, :32], s)
    with pytest.raises(ValueError, match="page_size"):
        quantize_kv(good, good, s, page_size=32)
    with pytest.raises(ValueError, match="page_size=64 must be a multiple"):
        quantize_kv(good, good, Scheme.make(2, k="channel", k_group=128), page_size=64)
    with pytest.raises(ValueError, match="lengths must lie"):
        quantize_kv(good, good, s, lengths=torch.tensor([65]))
    for lengths in (torch.tensor([1.0]), torch.tensor([True]), torch.tensor([5 + 0j])):  # (a bool was taken as 1)
        with pytest.raises(ValueError, match="lengths must be an integer tensor"):
            quantize_kv(good, good, s, lengths=lengths)
    with pytest.raises(TypeError, match="scheme"):
        quantize_kv(good, good, "int2")
    with pytest.raises(ValueError, match="layout must be one of"):
        quantize_kv(good, good, s, layout="ampere")
    with pytest.raises(ValueError, match="page_size must be one of"):
        quantize_kv(good, good, s, page_size=128.0)
    with pytest.raises(ValueError, match="page_size must be one of"):
        quantize_kv(good, good, s, page_size=True)
    with pytest.raises(ValueError, match="k must hold at least one sequence"):
        quantize_kv(good[:0], good[:0], s)
    with pytest.raises(ValueError, match="v must hold at least one sequence and one KV head"):
        quantize_kv(good, good[:, :0], s)
    with pytest.raises(ValueError, match="k is a meta tensor"):
        quantize_kv(good.to("meta"), good, s)
    for bad_value in (float("inf"), float("nan")):
        bad = good.clone()
        bad[0, 0, 0, 0] = bad_value
        with pytest.raises(ValueError, match="^k holds inf or nan"):
            quantize_kv(bad, good, s)
        with pytest.raises(ValueError, match="^v holds inf or nan"):
            quantize_kv(good, bad, s)
    huge = torch.full_like(good, 3e38)
    huge[..., ::2] = -3e38
    with pytest.raises(ValueError, match="^v exceeds the float16 range"):
        quantize_kv(good, huge, s)


@pytest.mark.parametrize("k_axis, k_group, v_axis, v_group, page_size", [
    ("token", 128, "token", 128, 64),
    ("channel", 64, "token", 128, 64),
    ("channel", 128, "token", 128, 128),  # the README's scheme: 64-token pages would split its K groups
    ("token", 64, "channel", 128, 128),
])
def test_default_page_size_is_the_smallest_that_holds_the_groups(k_axis, k_group, v_axis, v_group, page_size):
    s = Scheme.make(2, k_axis, k_group, v_axis, v_group)
    x = torch.randn(1, 1, 256, 128, dtype=torch.bfloat16)
    assert quantize_kv(x, x, s).page_size == page_size


def test_group_functions_reject_bad_input():
    quant = TensorQuant(Axis.TOKEN, 32, 2)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="x must have shape"):
        quantize_groups(torch.randn(64), quant)
    with pytest.raises(ValueError, match="TensorQuant.format must be a Format"):
        quantize_groups(x, TensorQuant(Axis.TOKEN, 32, 3))
    with pytest.raises(TypeError, match="quant must be a foscar.scheme.TensorQuant"):
        quantize_groups(x, (Axis.TOKEN, 32, 2))
    with pytest.raises(ValueError, match="token-wise group 128 must divide"):
        quantize_groups(x, TensorQuant(Axis.TOKEN, 128, 2))
    with pytest.raises(ValueError, match="channel-wise group 32 must divide the token count 4"):
        quantize_groups(x, TensorQuant(Axis.CHANNEL, 32, 2))
    with pytest.raises(ValueError, match="valid must have shape"):
        quantize_groups(x, quant, valid=torch.ones(5, dtype=torch.bool))
    codes, scale, offset = quantize_groups(x, quant)
    with pytest.raises(ValueError, match="scale must have shape"):
        dequantize_groups(codes, scale[:2], offset, quant)
    with pytest.raises(ValueError, match="offset must have shape"):
        dequantize_groups(codes, scale, offset[..., :1], quant)
    with pytest.raises(ValueError, match="codes must have shape"):
        dequantize_groups(codes[0, 0], scale, offset, quant)
