"""Formats written outside the package (tests/user_formats.py: INT8; a mixed K-INT8 / V-INT4 scheme) go
through everything a built-in format does: host quantize and the float64 references (CPU), both arches'
plans (Blackwell refuses 8-bit codes before compiling, with a one-line reason), the sm_90a decode and
cache-decode compiles (CPU), and on the GPU the decode kernel, the append kernel and PagedKVCache's
one-launch decode against float64 (fresh random inputs, poisoned outputs, every element). The decode
coverage matrix takes them through the registry (foscar.testing.coverage_matrix)."""

import math
from fractions import Fraction

import pytest
import torch
from test_scale_only_format import SCHEMES as SCALE_ONLY
from device_arch import skip_unless_builds
from user_formats import INT8, Int8

from foscar import Scheme
from foscar.archs import BLACKWELL, HOPPER
from foscar.cache import PagedKVCache
from foscar.compile_cache import entry_key
from foscar.formats import (FORMATS, PARAM_DTYPE, AppendRule, Construction, Format, MinMaxFormat, Unsupported,
                            affine_mismatch, kernel_construction, register_format)
from foscar.quantize import dequantize_groups, quantize_groups, quantize_kv
from foscar.reference import attend_dequantized, attend_folded
from foscar.scheme import HOPPER_FP16, TensorQuant

SCHEMES = [Scheme.make(format=INT8, k="token", k_group=128, v="token", v_group=128, head_dim=128, gqa_ratio=4),
           Scheme.make(format=INT8, k="channel", k_group=128, v="token", v_group=128, head_dim=128, gqa_ratio=4),
           Scheme.make(k="channel", k_group=128, v="token", v_group=128, head_dim=128, gqa_ratio=4, k_format="int8",
                       v_bits=4)]


def test_the_format_is_written_outside_the_package_and_registered():
    assert Int8.__module__ == "user_formats" and FORMATS["int8"] is INT8
    assert Scheme.make(8).k.format is INT8  # a bit width names the registered int<bits> format
    assert [s.name.split("-")[0] for s in SCHEMES] == ["int8", "int8", "k8v4"]
    assert SCHEMES[2].k.bits == 8 and SCHEMES[2].v.bits == 4
    assert register_format(Int8()) is not None  # the same format again: a no-op


def test_a_format_missing_a_method_is_refused_when_defined():
    with pytest.raises(TypeError, match=r"leaves \['construction'\] abstract"):
        class NoOperands(Format):
            name, bits = "no-operands", 4

            def quantize(self, grouped, mask, name):
                return MinMaxFormat.quantize(self, grouped, mask, name)

            def dequantize(self, codes, scale, offset):
                return codes * scale + offset
    with pytest.raises(TypeError, match="bits must be one of"):
        class Int3(MinMaxFormat):
            name, bits = "int3", 3
    with pytest.raises(ValueError, match="format name 'int8' is taken"):
        class Other(MinMaxFormat):
            name, bits = "int8", 4

        register_format(Other())


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_int8_quantizes_to_256_levels_within_half_a_step(axis, rng):
    quant = TensorQuant(axis, 64, INT8)
    x = torch.randn(2, 128, 128, generator=rng) * 3
    codes, scale, offset = quantize_groups(x, quant)
    assert int(codes.max()) == 255 and int(codes.min()) == 0
    err = (dequantize_groups(codes, scale, offset, quant) - x).abs()
    step = scale.float().repeat_interleave(64, dim=-1 if axis == "token" else -2)
    assert bool((err <= step / 2 + 1e-2 * step + 1e-6).all())


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_folded_reference_equals_dequantize_then_attend(scheme, rng):
    assert HOPPER.construction(scheme.k.format) is HOPPER_FP16[scheme.k.bits]
    k = (torch.randn(2, 2, 300, 128, generator=rng) + torch.randn(128, generator=rng)).to(scheme.q_dtype)
    v = torch.randn(2, 2, 300, 128, generator=rng).to(scheme.q_dtype)
    q = torch.randn(2, 8, 128, generator=rng).to(scheme.q_dtype)
    cache = quantize_kv(k, v, scheme, 128, torch.tensor([300, 129], dtype=torch.int32))
    out, lse = attend_dequantized(q, cache, 0.09)
    out_f, lse_f = attend_folded(q, cache, 0.09, "sm_90a")
    assert ((out_f - out).abs().max() / out.abs().max()) <= 1e-9
    assert ((lse_f - lse).abs() / lse.abs().clamp_min(1)).max() <= 1e-9


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_blackwell_refuses_8_bit_codes_before_compiling(scheme):
    from foscar.jit import compile_count

    before = compile_count()
    with pytest.raises(ValueError) as err:
        BLACKWELL.can_implement(scheme, 128)
    message = str(err.value)
    assert "\n" not in message and message.startswith("Scheme.k.format: int8:") and "at most 4 bits" in message
    with pytest.raises(ValueError, match="Scheme.k.format"):
        scheme.plan("sm_100a")
    assert compile_count() == before


class CentredInt4(MinMaxFormat):
    """Asks the Hopper kernel for operands ``c/16 - 1/2``: a construction that kernel does not build."""

    name, bits = "centred4", 4

    def construction(self, arch):
        if arch == "sm_90a":
            return Construction("fp16-c/16-1/2", "float16", Fraction(1, 16), Fraction(-1, 2))
        return super().construction(arch)


class CubedInt4(MinMaxFormat):
    """Dequantizes ``scale * (code - 8)^3 + offset``: not the affine value the kernels compute."""

    name, bits = "cubed4", 4

    def dequantize(self, codes, scale, offset):
        return (codes - 8) ** 3 * scale + offset


def _scheme_of(fmt):
    return Scheme.make(format=fmt, k="token", k_group=128, v="token", v_group=128, head_dim=128, gqa_ratio=4)


def test_a_construction_the_kernel_does_not_build_is_refused_before_compiling():
    """A format may only name the construction an arch's kernel builds from its width: another one would be folded
    with the wrong a and b and give wrong values silently. Blackwell, whose construction it keeps, takes it."""
    from foscar.jit import compile_count

    before = compile_count()
    with pytest.raises(Unsupported) as err:
        HOPPER.can_implement(_scheme_of(CentredInt4()), 128)
    assert str(err.value) == ("Scheme.k.format: centred4 asks for fp16-c/16-1/2 operands; the sm_90a kernel builds "
                              "fp16-c/16 from 4-bit codes")
    BLACKWELL.can_implement(_scheme_of(CentredInt4()), 128)
    assert compile_count() == before


def test_a_dequantize_that_is_not_affine_is_refused_by_every_kernel():
    """Every kernel computes scale * code + offset; a format that means something else is refused (decode on both
    arches, the dequantize and append kernels), naming a code where the two differ. Affine formats pass."""
    from foscar.kernels.dequantize import DequantizeConfig
    from foscar.kernels.quantize import QuantizeConfig

    scheme = _scheme_of(CubedInt4())
    assert "cubed4.dequantize does not (code 0, scale 0.5, offset -2.5: -258.5, kernels -2.5)" in affine_mismatch(
        CubedInt4())
    for arch in (HOPPER, BLACKWELL):
        with pytest.raises(Unsupported, match=r"^Scheme\.k\.format: the kernels dequantize scale \* code \+ offset"):
            arch.can_implement(scheme, 128)
    for config in (DequantizeConfig, QuantizeConfig):
        with pytest.raises(ValueError, match=r"^Scheme\.v\.format: the kernels dequantize"):
            config.of(scheme, "v")
    assert all(affine_mismatch(fmt) is None for fmt in FORMATS.values())


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_hopper_compiles_the_decode_and_the_cache_decode(scheme):
    from foscar.inspect import artifacts

    HOPPER.can_implement(scheme, 128)
    for compiled in (HOPPER.compile_decode(scheme, 128), HOPPER.compile_cache_decode(scheme, 128)):
        art = artifacts(compiled)
        assert ".target sm_90a" in art.ptx and art.loop_mix()["HMMA"] > 0


def test_cpu_cache_round_trip(rng):
    """PagedKVCache's torch path (quantize on append, attend) with INT8 pages."""
    from foscar.cache import PagedKVCache

    scheme = SCHEMES[1]
    cache = PagedKVCache(scheme, 1, 2, num_pages=16, max_seqs=2, max_seq_len=2048, sink=64, window=256, device="cpu")
    seq = cache.allocate()
    k = (torch.randn(1, 2, 900, 128, generator=rng) + torch.randn(128, generator=rng)).to(scheme.q_dtype)
    v = torch.randn(1, 2, 900, 128, generator=rng).to(scheme.q_dtype)
    cache.append(0, [seq], k, v)
    kd, vd = cache.dense(0, seq)
    assert (kd - k[0].float()).abs().max() < 0.05 and (vd - v[0].float()).abs().max() < 0.05  # 8-bit: fine steps
    q = torch.randn(1, 8, 128, generator=rng).to(scheme.q_dtype)
    out, lse = cache.attend(0, [seq], q, return_lse=True)
    scores = torch.einsum("hd,hnd->hn", q[0].double(), kd.repeat_interleave(4, 0).double()) * 128**-0.5
    ref = torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), vd.repeat_interleave(4, 0).double())
    assert (out[0].double() - ref).abs().max() < 1e-2
    assert (lse[0].double() - torch.logsumexp(scores, -1)).abs().max() < 1e-4


# ------------------------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES + SCALE_ONLY, ids=lambda s: s.name)
def test_decode_matches_float64_on_the_gpu(scheme):
    """INT8 and the scale-only symmetric INT4 (tests/test_scale_only_format.py's schemes), written outside the
    package: decode against float64."""
    from foscar.testing import check_decode

    skip_unless_builds(scheme, 128)  # (INT8 codes: Hopper only)
    acc = check_decode(scheme)
    print(scheme.name, acc)
    assert acc.ok, acc


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_cache_decode_matches_float64_on_the_gpu(scheme, rng):
    """The append kernel writes 8-bit pages and the one-launch cache decode attends them with the 16-bit
    sink + window, against float64 over what the cache holds."""
    from foscar.cache import PagedKVCache

    skip_unless_builds(scheme, 128)
    cache = PagedKVCache(scheme, 1, 2, num_pages=96, max_seqs=4, max_seq_len=8192, sink=64, window=256,
                         device="cuda")
    lengths = [1, 400, 3001]
    ids = [cache.allocate() for _ in lengths]
    for seq, n in zip(ids, lengths):
        k = torch.randn(1, 2, n, 128, generator=rng) + 2 * torch.randn(128, generator=rng)
        cache.append(0, [seq], k.to("cuda", scheme.q_dtype), torch.randn(1, 2, n, 128, generator=rng).to(
            "cuda", scheme.q_dtype))
    q = torch.randn(len(ids), 8, 128, generator=rng).to("cuda", scheme.q_dtype)
    out, lse = cache.attend(0, ids[::-1], q, return_lse=True)
    torch.cuda.synchronize()
    for b, seq in enumerate(ids[::-1]):
        kd, vd = cache.dense(0, seq)
        kd, vd = kd.repeat_interleave(4, 0).double(), vd.repeat_interleave(4, 0).double()
        scores = torch.einsum("hd,hnd->hn", q[b].double(), kd) * 128**-0.5
        ref = torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), vd)
        low = torch.einsum("hn,hnd->hd", torch.softmax((torch.einsum("hd,hnd->hn", q[b], kd.to(q.dtype)).float()
                                                        * 128**-0.5), -1).to(q.dtype), vd.to(q.dtype))
        tol = 2 * float((low.double() - ref).abs().max()) + 1e-5
        err = float((out[b].double() - ref).abs().max())
        assert math.isfinite(err) and err <= tol, (seq, err, tol)
        assert float((lse[b].double() - torch.logsumexp(scores, -1)).abs().max()) <= max(tol, 1e-3)
    assert not cache._counters.any()


# ------------------------------------------------------------------ a user's mistakes (a helper's audit, session 28)
def _centred_sweep(ratio: int, name: str) -> Format:
    """A scale-only 4-bit format ``x = s * (c + ratio)`` made by a factory (a sweep over the centre): every class it
    makes has the same source text."""
    class Sweep(Format):
        bits, param_fields, offset_per_scale = 4, 1, ratio
        append_rule = AppendRule("absmax", steps=7, shift=-ratio)

        def quantize(self, grouped, mask, name):
            a = torch.where(mask, grouped.abs(), 0.0).amax(dim=(-3, -1), keepdim=True)
            s = (a / torch.full_like(a, 7)).to(PARAM_DTYPE)
            s32 = s.float()
            c = (torch.round(grouped / torch.where(s32 == 0, 1.0, s32)) - ratio).clamp_(0, 15)
            return torch.where(mask & (s32 != 0), c, 0.0), s, None

        def dequantize(self, codes, scale, offset):
            return (codes + ratio) * scale

        def construction(self, arch):
            return kernel_construction(arch, 4)
    Sweep.name = name
    return Sweep()


def test_formats_of_one_source_never_share_a_compiled_kernel():
    """The disk cache keyed a format by its repr and its class's source: a factory's classes (or a class whose
    source cannot be read: ``python -c``, a notebook cell) with another ``offset_per_scale``, a constant of the
    kernel, got one entry, and the second format ran the first one's kernel."""
    a, b = _centred_sweep(-8, "sweep8"), _centred_sweep(-7, "sweep7")
    assert affine_mismatch(a) is None and affine_mismatch(b) is None
    keys = [("hopper_decode", Scheme.make(format=f, gqa_ratio=4), 128, "sm_90a") for f in (a, b)]
    assert entry_key(keys[0]) != entry_key(keys[1])


class _Signed4(Format):
    """Signed symmetric INT4 (codes -8..7, x = s*c): codes the packed 4-bit slots cannot hold."""
    name, bits, param_fields, offset_per_scale = "test-signed4", 4, 1, 0

    def quantize(self, grouped, mask, name):
        a = torch.where(mask, grouped.abs(), 0.0).amax(dim=(-3, -1), keepdim=True)
        s = (a / torch.full_like(a, 7)).to(PARAM_DTYPE)
        s32 = s.float()
        c = torch.round(grouped / torch.where(s32 == 0, 1.0, s32)).clamp_(-8, 7)
        return torch.where(mask & (s32 != 0), c, 0.0), s, None

    def dequantize(self, codes, scale, offset):
        return codes * scale

    def construction(self, arch):
        return kernel_construction(arch, 4)


class _Unclamped4(MinMaxFormat):
    name, bits = "test-unclamped4", 4

    def quantize(self, grouped, mask, name):
        c, s, z = MinMaxFormat.quantize(self, grouped, mask, name)
        return c + (c == 15).float(), s, z  # a top code of 16 carries into the next code's bits


class _Unrounded4(MinMaxFormat):
    name, bits = "test-unrounded4", 4

    def quantize(self, grouped, mask, name):
        c, s, z = MinMaxFormat.quantize(self, grouped, mask, name)
        return c + 0.75 * (c < 15), s, z  # fractional codes (the uint8 cast truncated them)


class _Fp32Params4(MinMaxFormat):
    name, bits = "test-fp32params4", 4

    def quantize(self, grouped, mask, name):
        c, s, z = MinMaxFormat.quantize(self, grouped, mask, name)
        return c, s.float(), z.float()


class _NoOffset4(MinMaxFormat):
    name, bits = "test-nooffset4", 4

    def quantize(self, grouped, mask, name):
        c, s, _ = MinMaxFormat.quantize(self, grouped, mask, name)
        return c, s, None


MISTAKES = [(_Signed4(), r"codes in -\d+ \.\. \d+: a 4-bit code is 0 \.\. 15"),
            (_Unclamped4(), r"codes in 0 \.\. 16"),
            (_Unrounded4(), "not whole numbers"),
            (_Fp32Params4(), "scale of torch.float32"),
            (_NoOffset4(), "no offset; a format with param_fields=2")]


@pytest.mark.parametrize("fmt, match", MISTAKES, ids=[fmt.name for fmt, _ in MISTAKES])
def test_what_a_format_quantizes_to_is_checked_before_it_is_stored(fmt, match, rng):
    """Codes went into the packed words unchecked (cast to uint8 and added: a code out of range changed its
    neighbour, max error 10.5 at |K| <= 4.3 for signed INT4) and so did params of another dtype or a missing
    offset (an error from deep inside torch, or none until the decode): refused, naming the format."""
    k = torch.randn(1, 1, 128, 128, generator=rng).bfloat16()
    scheme = Scheme.make(format=fmt, gqa_ratio=4)
    with pytest.raises(ValueError, match=f"{fmt.name}.quantize returned (.* )?{match}"):
        quantize_kv(k, k, scheme, 128)
    cache = PagedKVCache(scheme, 1, 1, 4, 1, 512, sink=0, window=64, device="cpu")
    cache.allocate()
    with pytest.raises(ValueError, match=f"{fmt.name}.quantize returned"):
        cache.append(0, [0], k[:, :, :128], k[:, :, :128])
    assert cache.seq_len(0) == 0


class _Midpoint4(MinMaxFormat):
    """The stored offset is the group's midpoint: x = s*(c - 7.5) + mid, not the kernels' s*c + z."""
    name, bits = "test-midpoint4", 4

    def dequantize(self, codes, scale, offset):
        return (codes - 7.5) * scale + offset


def test_the_folded_reference_refuses_a_format_the_folds_cannot_take(rng):
    """``attend_folded`` applied s*c + z to any format (a midpoint format came out 3.3 off its own definition)."""
    k = torch.randn(1, 1, 128, 128, generator=rng).bfloat16()
    cache = quantize_kv(k, k, Scheme.make(format=_Midpoint4(), gqa_ratio=4), 128)
    q = torch.randn(1, 4, 128, generator=rng).bfloat16()
    attend_dequantized(q, cache, 0.1)  # the dequantize-then-attend reference takes any format
    with pytest.raises(ValueError, match="k: a format the folds cannot take: the kernels dequantize scale"):
        attend_folded(q, cache, 0.1)


class _Divided4(MinMaxFormat):
    name, bits = "test-divided4", 4

    def __init__(self, divisor):
        self.divisor = divisor

    def dequantize(self, codes, scale, offset):
        return (codes * scale + offset) / self.divisor


def test_formats_with_other_attributes_are_other_formats():
    """Formats compared (and the probes cached their verdicts) by class alone: a second instance with another
    parameter took the first one's 'affine' and its kernels."""
    assert _Divided4(1.0) == _Divided4(1.0) and hash(_Divided4(1.0)) == hash(_Divided4(1.0))
    assert _Divided4(1.0) != _Divided4(0.5) and repr(_Divided4(0.5)) == "_Divided4(divisor=0.5)"
    assert affine_mismatch(_Divided4(1.0)) is None
    assert affine_mismatch(_Divided4(0.5)) is not None
    try:
        assert register_format(_Divided4(1.0)) is FORMATS["test-divided4"]
        assert register_format(_Divided4(1.0)) is FORMATS["test-divided4"]  # an equal one: a no-op
        with pytest.raises(ValueError, match="format name 'test-divided4' is taken by _Divided4"):
            register_format(_Divided4(0.5))
    finally:
        FORMATS.pop("test-divided4", None)  # the registry is the process's
