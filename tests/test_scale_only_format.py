"""A scale-only format written outside the package: symmetric INT4 (``x = scale * (code - 8)``, one fp16 scale per
group and no offset: half the params bytes of min-max INT4; ``SymInt4`` of tests/user_formats.py, registered). It is
still affine -- its offset a fixed multiple of its scale (``Format.offset_per_scale = -8``) -- so every kernel takes
it: both arches' decode and cache decode read one fp16 per group and derive the offset in registers, the append kernel
quantizes by its ``AppendRule`` (bit-exact with the host quantizer), the dequantize kernel computes ``fma(s, c,
-8 s)``. CPU: the host paths, the declarations and their checks, every kernel's compile on both arches, the kernels'
arithmetic emulated against float64; GPU: the cache, append and dequantize kernels against float64 and the host
quantizer (the decode: tests/test_user_formats.py, over these schemes too)."""

import math
from fractions import Fraction

import pytest
import torch
from test_blackwell import emulate_kernel
from test_cache import attention, check_attend, kv
from test_cache_chunk import check_chunk
from user_formats import SYM_INT4, SymInt4

from foscar import Scheme
from foscar.archs import BLACKWELL, HOPPER
from foscar.cache import PagedKVCache
from foscar.formats import FORMATS, PARAM_DTYPE, AppendRule, Unsupported, affine_mismatch, append_mismatch
from foscar.kernels.dequantize import DequantizeConfig, compile_dequantize
from foscar.kernels.quantize import QuantizeConfig, compile_quantize
from foscar.quantize import dequantize_groups, quantize_groups, quantize_kv
from foscar.reference import attend_dequantized, attend_dequantized_torch, attend_folded
from foscar.scheme import TensorQuant
from foscar.testing import ATOL_FLOOR, random_problem

SYM = SYM_INT4
SCHEME = Scheme.make(format=SYM, k="channel", k_group=64, v="token", v_group=64, head_dim=64, gqa_ratio=2)
# the other two fold cases, and a mixed scheme (scale-only K next to min-max INT2 V, whose params keep pairs)
OTHER = Scheme.make(format=SYM, k="token", k_group=128, v="channel", v_group=128, head_dim=128, gqa_ratio=4)
MIXED = Scheme.make(k="channel", k_group=128, v="token", v_group=128, head_dim=128, gqa_ratio=4, k_format=SYM,
                    v_bits=2)
SCHEMES = [SCHEME, OTHER, MIXED]


def test_the_format_is_written_outside_the_package_and_registered():
    assert SymInt4.__module__ == "user_formats" and FORMATS["sym-int4"] is SYM
    assert (SYM.param_fields, SYM.offset_per_scale, SYM.append_rule) == (1, -8, AppendRule("absmax", 7, 8))
    assert [s.name.split("-k")[0] for s in SCHEMES] == ["sym-int4", "sym-int4", "ksym-int4v2"]


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


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_the_kernels_copy_half_the_params_words(scheme):
    """What a packed tile brings into the decode kernels' rings: one fp16 per group, so half the params words (and
    bytes that the copies' expect_tx counts) of the same scheme in min-max INT4."""
    from foscar.blackwell.kernel import BlackwellConfig
    from foscar.hopper.kernel import DecodeConfig

    minmax = Scheme.make(k=scheme.k.axis.value, k_group=scheme.k.group, v=scheme.v.axis.value,
                         v_group=scheme.v.group, head_dim=scheme.head_dim, gqa_ratio=scheme.gqa_ratio,
                         k_bits=scheme.k.bits, v_bits=scheme.v.bits)
    for config in (lambda s: DecodeConfig(s, 128, False, 1), lambda s: BlackwellConfig(s, 128, False)):
        ours, theirs = config(scheme), config(minmax)
        halves = [q.param_fields == 1 for q in (scheme.k, scheme.v)]
        assert (ours.KPW, ours.VPW) == tuple(w // 2 if h else w for w, h in zip((theirs.KPW, theirs.VPW), halves))
        assert ours.STAGE_WORDS == theirs.STAGE_WORDS - (theirs.KPW - ours.KPW) - (theirs.VPW - ours.VPW)
        assert ours.KPW % 4 == 0 and ours.VPW % 4 == 0  # 16-byte bulk copies and ring offsets


def test_the_float64_reference_reads_the_packed_pages(rng):
    """quantize_kv packs one fp16 per group; the dequantize-then-attend reference over the pages equals attention
    over quantize_groups' values, and the folded reference (offset = -8 * scale) equals both."""
    k, v = kv(rng, SCHEME, 2, 320)
    lengths = (320, 192)  # whole channel-wise K groups, so quantize_groups can take each sequence alone
    cache = quantize_kv(k, v, SCHEME, 64, lengths=torch.tensor(lengths))
    assert cache.k_params.shape[-1] == 1 and cache.v_params.shape[-1] == 1
    q = torch.randn(2, 2 * SCHEME.gqa_ratio, 64, generator=rng).to(SCHEME.q_dtype)
    out, lse = attend_dequantized(q, cache, 0.1)
    for arch in ("sm_90a", "sm_100a"):
        folded, folded_lse = attend_folded(q, cache, 0.1, arch)
        assert (folded - out).abs().max() < 1e-9 and (folded_lse - lse).abs().max() < 1e-9
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
    k, v = kv(rng, SCHEME, 2, 700)
    for start, stop in ((0, 333), (333, 334), (334, 700)):
        cache.append(0, ids, k[:, :, start:stop], v[:, :, start:stop])
    held = {seq: (k[b], v[b]) for b, seq in enumerate(ids)}
    assert cache.quantized_tokens(700) > 0
    check_attend(cache, ids, held, rng)
    check_chunk(cache, ids, lambda seq: cache.dense(0, seq), rng, 37)


# ------------------------------------------------------------------------------------ declarations and probes

def test_offset_per_scale_is_declared_exactly_by_a_scale_only_format():
    for fields, ratio in ((1, None), (2, -8), (1, True), (1, -8.0)):
        with pytest.raises(TypeError, match="offset_per_scale .* is required exactly where param_fields is 1"):
            type("Bad", (SymInt4,), {"name": "bad", "param_fields": fields, "offset_per_scale": ratio})
    with pytest.raises(TypeError, match="append_rule must be a foscar.formats.AppendRule"):
        type("Bad", (SymInt4,), {"name": "bad", "append_rule": ("absmax", 7, 8)})
    with pytest.raises(TypeError, match="param_fields must be 1 .scale. or 2 .scale, offset., got 3"):
        class Three(SymInt4):
            name, param_fields = "three-fields", 3
    with pytest.raises(ValueError, match="AppendRule.range must be one of"):
        AppendRule("rms", 7)


class SevenOffInt4(SymInt4):
    """Declares offset -8 * scale but dequantizes (code - 7) * scale: not what the kernels would compute."""

    name = "seven-off4"

    def dequantize(self, codes, scale, offset):
        return (codes - 7) * scale


class NoRuleInt4(SymInt4):
    name, append_rule = "no-rule4", None


class WrongRuleInt4(SymInt4):
    """Its rule divides the range by 8, its host quantizer by 7."""

    name, append_rule = "wrong-rule4", AppendRule("absmax", 8, 8)


class CubedSymInt4(SymInt4):
    """Scale-only but not affine: ``scale * (code - 8)^3``."""

    name = "cubed-sym4"

    def dequantize(self, codes, scale, offset):
        return (codes - 8) ** 3 * scale


def _with(fmt):
    return Scheme.make(format=fmt, k="channel", k_group=64, v="token", v_group=64, head_dim=64, gqa_ratio=2)


def test_the_affine_probe_checks_the_derived_offset():
    assert affine_mismatch(SYM) is None
    assert "seven-off4.dequantize does not (code 0, scale 0.5, offset -4.0: -3.5, kernels -4.0)" in affine_mismatch(
        SevenOffInt4())


def test_the_append_rule_is_held_against_the_host_quantizer(rng):
    """The append kernel runs the rule; the rule's torch emulation is the host quantizer bit for bit on random
    groups (and on append_mismatch's probe), for the scale-only format and for the built-in min-max ones."""
    for fmt in FORMATS.values():
        assert append_mismatch(fmt) is None, fmt
        grouped = torch.randn(3, 64, 2, 1, generator=rng) * torch.rand(1, 1, 2, 1, generator=rng) * 10
        got = fmt.append_rule.emulate(grouped, fmt.bits, fmt.param_fields)
        want = fmt.quantize(grouped, torch.ones_like(grouped, dtype=torch.bool), "k")
        for a, b in zip(got, want):
            assert (a is None and b is None) or torch.equal(a, b)
    assert "no-rule4 declares no append_rule" in append_mismatch(NoRuleInt4())
    assert append_mismatch(WrongRuleInt4()).startswith("the append kernel quantizes by AppendRule(range='absmax', "
                                                       "steps=8, shift=8) and gets other codes than wrong-rule4")


def test_what_the_kernels_refuse_of_a_scale_only_format_before_compiling():
    """A non-affine one (every kernel), a rule that is not its host quantizer's, or none (the append kernel), a
    construction other than the kernel's (decode); nothing compiles."""
    from foscar.jit import compile_count

    before = compile_count()
    for arch in (HOPPER, BLACKWELL):
        with pytest.raises(Unsupported, match=r"^Scheme\.k\.format: the kernels dequantize scale \* code \+ offset"):
            arch.can_implement(_with(CubedSymInt4()), 128)
    for config in (DequantizeConfig, QuantizeConfig):
        with pytest.raises(ValueError, match=r"^Scheme\.v\.format: the kernels dequantize"):
            config.of(_with(SevenOffInt4()), "v")
    for fmt, reason in ((NoRuleInt4(), "declares no append_rule"), (WrongRuleInt4(), "gets other codes")):
        with pytest.raises(ValueError, match=rf"^Scheme\.k\.format: .*{reason}"):
            QuantizeConfig.of(_with(fmt), "k")
        DequantizeConfig.of(_with(fmt), "k")  # the other kernels do not quantize
        HOPPER.can_implement(_with(fmt), 128)
        for arch in (HOPPER, BLACKWELL):  # a cache quantizes on append: refused when built, before any append
            with pytest.raises(Unsupported, match=rf"^Scheme\.k\.format: .*{reason}"):
                arch.check_cache(_with(fmt), 128, 64 + 256 + 128)

    class CentredSymInt4(SymInt4):
        name = "centred-sym4"

        def construction(self, arch):
            from foscar.formats import Construction
            return Construction("fp16-c/16-1/2", "float16", Fraction(1, 16), Fraction(-1, 2))

    with pytest.raises(Unsupported, match="centred-sym4 asks for fp16-c/16-1/2 operands; the sm_90a kernel builds"):
        HOPPER.can_implement(_with(CentredSymInt4()), 128)
    assert compile_count() == before


# ------------------------------------------------------------------------------------ kernels (CPU: compile)

@pytest.mark.parametrize("arch", [HOPPER, BLACKWELL], ids=lambda a: a.name)
@pytest.mark.parametrize("scheme", SCHEMES[:2], ids=lambda s: s.name)
def test_every_kernel_compiles_for_both_arches(scheme, arch):
    """Decode, cache decode, append and dequantize kernels of the scale-only scheme (the four fold cases over the two
    schemes), without spills."""
    from foscar.inspect import artifacts

    arch.can_implement(scheme, 128)
    kernels = [arch.compile_decode(scheme, 128), arch.compile_cache_decode(scheme, 128)]
    for role in ("k", "v"):
        kernels.append(compile_quantize(QuantizeConfig.of(scheme, role, arch.layout), arch=arch.name))
        kernels.append(compile_dequantize(DequantizeConfig.of(scheme, role, layout=arch.layout), arch=arch.name))
    for compiled in kernels:
        art = artifacts(compiled)
        assert f".target {arch.name}" in art.ptx and art.resources().local_bytes == 0


def test_the_append_kernel_writes_the_scale_only():
    """Its params writes: one fp16 per group (no offset), the scale ``absmax / 7`` by IEEE division, codes
    ``roundeven(x / s) + 8`` (PTX: no subtraction of a stored offset)."""
    from foscar.inspect import artifacts

    cfg = QuantizeConfig.of(SCHEME, "v")
    assert (cfg.param_fields, cfg.rule) == (1, SYM.append_rule)
    ptx = artifacts(compile_quantize(cfg, arch="sm_90a")).ptx
    assert "div.rn.f32" in ptx and "cvt.rni.f32.f32" in ptx and "abs.f32" in ptx
    assert ptx.count("st.global.b16") + ptx.count("st.global.u16") == 1  # the scale; pairs write two


# ------------------------------------------------------------------------------------ kernel arithmetic, emulated

KT_VT = Scheme.make(format=SYM, k="token", k_group=64, v="token", v_group=64, head_dim=64, gqa_ratio=2)
# Blackwell: K token-wise (its channel-wise K: see the docstring), both V cases; sequences of at least a tile
EMULATED = [("sm_90a", s, (1, 65, 700)) for s in SCHEMES] + [("sm_100a", s, (129, 700)) for s in (OTHER, KT_VT)]


@pytest.mark.parametrize("arch, scheme, lengths", EMULATED, ids=lambda p: getattr(p, "name", str(p)))
def test_the_kernels_arithmetic_meets_the_accuracy_rule(arch, scheme, lengths, rng):
    """Both kernels' arithmetic emulated on the CPU (Hopper: the folded plan with FP16 MMA operands, offset = -8 *
    scale; Blackwell: emulate_kernel's FP8 hi/lo operands) against float64 dequantize-then-attend, within the rule
    of foscar.testing (2x a BF16 PyTorch dequantize-then-SDPA + ATOL_FLOOR; lse within max(that, 1e-3)).

    Left out, measured: the Blackwell emulation exceeds the rule on sequences shorter than a tile for min-max INT2
    and INT4 as well (up to 2.6x, head_dim 64), and with K channel-wise the scale-only format errs about twice as
    much as min-max INT4 there (its codes sit around 8, so the -8 * scale correction cancels a larger MMA term of
    FP8-rounded Q * scale): up to 1.07x the rule for the output and 2.3x for lse over 200 seeds (min-max INT4:
    0.41x and 0.9x)."""
    sm_scale = scheme.head_dim**-0.5
    q, cache = random_problem(scheme, lengths, kv_heads=2, page_size=128, device="cpu", generator=rng,
                              layout="hopper" if arch == "sm_90a" else "blackwell")
    ref, ref_lse = attend_dequantized(q, cache, sm_scale)
    tol = 2 * float((attend_dequantized_torch(q, cache, sm_scale).double() - ref).abs().max()) + ATOL_FLOOR
    if arch == "sm_90a":
        out, lse = attend_folded(q, cache, sm_scale, arch, operand_dtype=torch.float16)
    else:
        out, lse = emulate_kernel(q, cache, sm_scale)
    err = float((out.to(q.dtype).double() - ref).abs().max())  # the kernels write q's dtype
    assert err <= tol, (err, tol)
    assert float((lse - ref_lse).abs().max()) <= max(tol, 1e-3)


# ------------------------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_cache_appends_and_attends_through_the_kernels(scheme, rng):
    """The append kernel writes scale-only pages (dense(), the torch dequantizer over them, is the host quantizer's
    values exactly) and the cache decode attends them with the 16-bit sink + window, every element against float64
    over what the cache holds."""
    from test_cache import expected_dense

    d, ratio = scheme.head_dim, scheme.gqa_ratio
    cache = PagedKVCache(scheme, 1, 2, num_pages=96, max_seqs=4, max_seq_len=8192, sink=64, window=256,
                         device="cuda")
    assert cache.use_kernels
    lengths = [1, 400, 3001]
    ids = [cache.allocate() for _ in lengths]
    held = {}
    for seq, n in zip(ids, lengths):
        k = (torch.randn(1, 2, n, d, generator=rng) + 2 * torch.randn(d, generator=rng)).to(scheme.q_dtype)
        v = torch.randn(1, 2, n, d, generator=rng).to(scheme.q_dtype)
        for start, stop in ((0, n // 3), (n // 3, n // 3 + 1), (n // 3 + 1, n)):
            if stop > start:  # (a one-token sequence has empty thirds: append takes >= 1 token)
                cache.append(0, [seq], k[:, :, start:stop].cuda(), v[:, :, start:stop].cuda())
        held[seq] = (k[0], v[0])
    q = torch.randn(len(ids), 2 * ratio, d, generator=rng).to("cuda", scheme.q_dtype)
    out, lse = cache.attend(0, ids[::-1], q, return_lse=True)
    torch.cuda.synchronize()
    for b, seq in enumerate(ids[::-1]):
        kd, vd = expected_dense(cache, *held[seq])
        assert all(torch.equal(x.cpu(), y) for x, y in zip(cache.dense(0, seq), (kd, vd))), seq
        kd, vd = kd.repeat_interleave(ratio, 0).double(), vd.repeat_interleave(ratio, 0).double()
        qb = q[b].cpu()
        scores = torch.einsum("hd,hnd->hn", qb.double(), kd) * d**-0.5
        ref = torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), vd)
        low = torch.einsum("hn,hnd->hd", torch.softmax((torch.einsum("hd,hnd->hn", qb, kd.to(qb.dtype)).float()
                                                        * d**-0.5), -1).to(qb.dtype), vd.to(qb.dtype))
        tol = 2 * float((low.double() - ref).abs().max()) + ATOL_FLOOR
        err = float((out[b].cpu().double() - ref).abs().max())
        assert math.isfinite(err) and err <= tol, (seq, err, tol)
        assert float((lse[b].cpu().double() - torch.logsumexp(scores, -1)).abs().max()) <= max(tol, 1e-3)
    assert not cache._counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["hopper", "blackwell"])
@pytest.mark.parametrize("role", ["k", "v"])
def test_the_append_kernel_is_the_host_quantizer_bit_for_bit(role, layout, rng):
    """quantize_tiles (SIMT: either arch's bit order on any GPU) against quantize_groups + the layout's packer:
    every code word and every scale's bits, constant and tiny and outlier groups included; skipped granules keep
    their sentinels."""
    from test_quantize_kernel import torch_quantize

    from foscar.kernels.quantize import quantize_tiles

    cfg = QuantizeConfig.of(OTHER, role, layout)
    kvh, num_pages, page_size, tiles = 3, 7, 256, 9
    src = torch.randn(tiles, kvh, cfg.granule, cfg.head_dim, generator=rng) * 3 + torch.randn(cfg.head_dim,
                                                                                              generator=rng) * 4
    src[0] = 0.5  # constant groups
    src[1] *= 1e-3  # tiny ranges
    src[2, :, :, :8] = -100.0  # outliers
    src[3] = 0.0  # zero groups: scale 0, codes 0
    src = src.to(OTHER.q_dtype)
    page = torch.randperm(num_pages, generator=rng)[:6].to(torch.int32)
    page = torch.cat([page, torch.full((tiles - 6,), -1, dtype=torch.int32)])  # three granules skipped
    slot = (torch.randint(0, page_size // cfg.granule, (tiles,), generator=rng) * cfg.granule).to(torch.int32)
    codes = torch.full((num_pages, kvh, page_size // 64, cfg.geometry.words), 0x5A5A5A5A, dtype=torch.int32)
    quant = OTHER.k if role == "k" else OTHER.v
    params = torch.full((num_pages, kvh, *quant.params_shape(page_size, cfg.head_dim), 1), 7.0, dtype=torch.float16)
    want_codes, want_params = codes.clone(), params.clone()
    torch_quantize(src, cfg, want_codes, want_params, page.tolist(), slot.tolist(), quant.format)
    got_codes, got_params = codes.cuda(), params.cuda()
    quantize_tiles(src.cuda(), page.cuda(), slot.cuda(), got_codes, got_params, OTHER, role, layout)
    torch.cuda.synchronize()
    assert torch.equal(got_params.cpu().view(torch.int16), want_params.view(torch.int16))
    assert torch.equal(got_codes.cpu(), want_codes)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["hopper", "blackwell"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_dequantize_kernel_is_the_host_dequantizer(dtype, layout, rng):
    """dequantize_pages of a quantize_kv cache against its torch dequantizer in float64 rounded once (the kernel's
    one FMA, exact here: ``s * (c - 8)`` fits FP32), every element of every valid token of a NaN-poisoned output."""
    from foscar.kernels import dequantize_pages

    for scheme in SCHEMES:
        k, v = kv(rng, scheme, 2, 300)
        lengths = torch.tensor([300, 200], dtype=torch.int32)
        cache = quantize_kv(k.cuda(), v.cuda(), scheme, page_size=128, lengths=lengths, layout=layout)
        exact = cache.dequantize(torch.float64)
        for i, role in enumerate(("k", "v")):
            codes, params = (cache.k_codes, cache.k_params) if role == "k" else (cache.v_codes, cache.v_params)
            out = torch.full((2, 2, cache.max_tokens, scheme.head_dim), torch.nan, dtype=dtype, device="cuda")
            dequantize_pages(codes, params, cache.page_table, scheme, role, dtype, layout=layout, out=out)
            for b, length in enumerate(lengths.tolist()):
                assert torch.equal(out[b, :, :length], exact[i][b, :, :length].float().to(dtype)), (scheme.name, role)
