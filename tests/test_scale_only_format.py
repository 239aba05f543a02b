"""A scale-only format written outside the package: symmetric INT4 (``x = scale * (code - 8)``, one fp16 scale per
group and no offset: half the params bytes of min-max INT4). The host paths take it (quantize, the float64
references, PagedKVCache's torch path); every kernel refuses it before compiling, with the reason (they read
(scale, offset) pairs), so it is not registered: the registry feeds the kernels' coverage matrix."""

import pytest
import torch
from test_cache import attention, check_attend, kv
from test_cache_chunk import check_chunk

from foscar import Scheme
from foscar.archs import BLACKWELL, HOPPER
from foscar.cache import PagedKVCache
from foscar.formats import PARAM_DTYPE, Format, Unsupported, affine_mismatch
from foscar.quantize import dequantize_groups, quantize_groups, quantize_kv
from foscar.reference import attend_dequantized, attend_folded
from foscar.scheme import TensorQuant


class SymInt4(Format):
    """Symmetric INT4: ``scale = fp16(absmax / 7)`` per group, ``code = clamp(round(x / scale) + 8, 0, 15)``."""

    name, bits, param_fields = "sym-int4", 4, 1

    def quantize(self, grouped, mask, name):
        absmax = torch.where(mask, grouped.abs(), 0.0).amax(dim=(-3, -1), keepdim=True)
        scale = (absmax / torch.full_like(absmax, 7)).to(PARAM_DTYPE)
        if not torch.isfinite(scale).all():
            raise ValueError(f"{name} exceeds the float16 range of the group scale")
        s32 = scale.to(torch.float32)
        codes = (torch.round(grouped / torch.where(s32 == 0, 1.0, s32)) + 8).clamp_(0, 15)
        return torch.where(mask & (s32 != 0), codes, 0.0), scale, None

    def dequantize(self, codes, scale, offset):
        return (codes - 8) * scale

    def construction(self, arch):
        raise Unsupported(f"{self.name}: no operand construction for scale-only codes on {arch}")


SYM = SymInt4()
SCHEME = Scheme.make(format=SYM, k="channel", k_group=64, v="token", v_group=64, head_dim=64, gqa_ratio=2)


def test_quantize_is_within_half_a_step_and_stores_the_scale_only(rng):
    quant = TensorQuant("token", 64, SYM)
    x = torch.randn(2, 128, 128, generator=rng) * 3
    codes, scale, offset = quantize_groups(x, quant)
    assert offset is None and scale.shape == (2, 128, 2) and scale.dtype == PARAM_DTYPE
    back = dequantize_groups(codes, scale, None, quant)
    step = scale.float().repeat_interleave(64, -1)
    assert ((back - x).abs() <= step / 2 + 1e-6).all()
    assert int(codes.min()) >= 1 and int(codes.max()) == 15  # -7..7 around 8: the grid is symmetric
    with pytest.raises(ValueError, match="offset must be None exactly for a scale-only format"):
        dequantize_groups(codes, scale, scale, quant)


def test_params_take_half_the_bytes_of_min_max_int4():
    minmax = Scheme.make(format="int4", k="channel", k_group=64, v="token", v_group=64, head_dim=64, gqa_ratio=2)
    assert minmax.bytes_per_element() - SCHEME.bytes_per_element() == pytest.approx(2 / 64)
    caches = [PagedKVCache(s, 1, 2, 8, 2, 1024, sink=16, window=128, device="cpu") for s in (SCHEME, minmax)]
    assert caches[0].k_params.shape[-1] == 1 and caches[1].k_params.shape[-1] == 2
    assert 2 * caches[0].k_params.numel() == caches[1].k_params.numel()
    assert caches[0]._planned_bytes()["the page pool (num_pages)"] < caches[1]._planned_bytes()[
        "the page pool (num_pages)"]


def test_the_float64_reference_reads_the_packed_pages(rng):
    """quantize_kv packs one fp16 per group; the dequantize-then-attend reference over the pages equals attention
    over quantize_groups' values."""
    k, v = kv(rng, SCHEME, 2, 320)
    lengths = (320, 192)  # whole channel-wise K groups, so quantize_groups can take each sequence alone
    cache = quantize_kv(k, v, SCHEME, 64, lengths=torch.tensor(lengths))
    assert cache.k_params.shape[-1] == 1 and cache.v_params.shape[-1] == 1
    q = torch.randn(2, 2 * SCHEME.gqa_ratio, 64, generator=rng).to(SCHEME.q_dtype)
    out, lse = attend_dequantized(q, cache, 0.1)
    for b, n in enumerate(lengths):
        dense = [dequantize_groups(*quantize_groups(x[b, :, :n], quant), quant) for x, quant in ((k, SCHEME.k),
                                                                                                (v, SCHEME.v))]
        ref, ref_lse = attention(q[b], *dense, 0.1)
        assert (out[b] - ref).abs().max() < 1e-9 and (lse[b] - ref_lse).abs().max() < 1e-9


def test_the_cpu_cache_appends_attends_and_takes_chunks(rng):
    """PagedKVCache's torch path: appends crossing pages, decode attends and a chunk against float64 over what the
    sequences hold (the pages read back through the format's dequantize)."""
    cache = PagedKVCache(SCHEME, 1, 2, 24, 2, 1500, sink=16, window=128, device="cpu")
    ids = [cache.allocate() for _ in range(2)]
    held = {}
    k, v = kv(rng, SCHEME, 2, 700)
    for start, stop in ((0, 333), (333, 334), (334, 700)):
        cache.append(0, ids, k[:, :, start:stop], v[:, :, start:stop])
    held = {seq: (k[b], v[b]) for b, seq in enumerate(ids)}
    assert cache.quantized_tokens(700) > 0
    check_attend(cache, ids, held, rng)
    check_chunk(cache, ids, lambda seq: cache.dense(0, seq), rng, 37)


def test_every_kernel_refuses_it_before_compiling():
    from foscar.jit import compile_count
    from foscar.kernels.dequantize import DequantizeConfig
    from foscar.kernels.quantize import QuantizeConfig

    before = compile_count()
    assert affine_mismatch(SYM) == ("sym-int4 stores its scale only (param_fields=1); the kernels read (scale, "
                                    "offset) pairs")
    for arch in (HOPPER, BLACKWELL):
        with pytest.raises(Unsupported, match=r"^Scheme\.k\.format: sym-int4: no operand construction"):
            arch.can_implement(SCHEME, 128)
    with pytest.raises(ValueError, match=r"^Scheme\.k\.format: sym-int4 stores its scale only"):
        DequantizeConfig.of(SCHEME, "k")
    with pytest.raises(ValueError, match=r"^Scheme\.k\.format: the append kernel rounds as .*MinMaxFormat does"):
        QuantizeConfig.of(SCHEME, "k")
    with pytest.raises(Unsupported, match="Scheme.k.format"):
        attend_folded(torch.zeros(1, 2, 64, dtype=SCHEME.q_dtype), quantize_kv(*(torch.randn(1, 1, 64, 64).to(SCHEME.q_dtype),) * 2, SCHEME, 64), 0.1)
    assert compile_count() == before


def test_a_format_with_another_param_count_is_refused_when_defined():
    with pytest.raises(TypeError, match="param_fields must be 1 .scale. or 2 .scale, offset., got 3"):
        class Three(SymInt4):
            name, param_fields = "three-fields", 3
