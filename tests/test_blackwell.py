"""Blackwell (sm_100a) variant: layout + FP4/FP8 recipes bit-exact on the CPU, FP8 hi/lo accuracy
emulation, compile-only PTX/SASS checks, and GPU tests that only run on sm_100."""

import dataclasses
import re

import pytest
import torch

from foscar.blackwell.operands import build_word, construction_for, tile_operand_bits, tile_operands
from foscar.layouts import TileGeometry
from foscar.layouts.blackwell import BlackwellTile, bw_pack_tiles, bw_tile_position, bw_unpack_tiles
from foscar.operands import e2m1_value, e4m3_value
from foscar.scheme import BLACKWELL_FP4, BLACKWELL_FP8, Scheme
from foscar.testing import coverage_matrix

GEOMETRIES = [TileGeometry(r, b, d) for r in "kv" for b in (2, 4) for d in (64, 128, 256)]


# ------------------------------------------------------------------------------------ CPU: layout + recipes
@pytest.mark.parametrize("geom", GEOMETRIES, ids=str)
def test_blackwell_layout_is_a_bijection_and_round_trips(geom, rng):
    seen = {bw_tile_position(geom, t, c) for t in range(64) for c in range(geom.head_dim)}
    assert seen == set(range(64 * geom.head_dim))
    codes = torch.randint(0, 2**geom.bits, (2, 64, geom.head_dim), generator=rng, dtype=torch.uint8)
    assert torch.equal(bw_unpack_tiles(bw_pack_tiles(codes, geom), geom), codes)


@pytest.mark.parametrize("geom", GEOMETRIES, ids=str)
def test_recipe_codes_to_bits_to_values_bit_exact(geom, rng):
    """codes -> packed words -> (w & M, (w >> bits) & M) -> FP4 nibbles / E4M3 bytes -> values."""
    codes = torch.randint(0, 2**geom.bits, (64, geom.head_dim), generator=rng, dtype=torch.uint8)
    words = bw_pack_tiles(codes, geom)
    bits_ = tile_operand_bits(words, geom)  # [M rows, K cols] element bit patterns
    mk = codes if geom.role == "k" else codes.T
    # the bit pattern of every operand element IS the code (zero-extension)
    assert torch.equal(bits_, mk.to(torch.int64))
    # ... and decodes to the construction's value a*c + b exactly
    con = construction_for(geom.bits)
    assert torch.equal(tile_operands(words, geom), con.operand(codes))


def test_constructions_are_exact_for_every_code():
    c2, c4 = torch.arange(4), torch.arange(16)
    assert torch.equal(e2m1_value(c2), BLACKWELL_FP4.operand(c2))  # nibble c = c/2
    assert torch.equal(e4m3_value(c4.to(torch.uint8)), BLACKWELL_FP8.operand(c4))  # byte c = c*2^-9
    assert BLACKWELL_FP4.b == 0 and BLACKWELL_FP8.b == 0  # no construction bias to cancel


@pytest.mark.parametrize("bits", [2, 4])
def test_recipe_masks_both_halves_of_a_word(bits):
    tile = BlackwellTile("k", bits, 128)
    w = torch.tensor([-1], dtype=torch.int32)
    lo, hi = build_word(w, bits)
    assert int(lo) == tile.mask == int(hi)  # lo = w & M, hi = (w >> shift) & M


# ------------------------------------------------------------------------------------ CPU: FP8 accuracy
def _pow2_norm(amax):
    """The kernel's power-of-two normalisation 2^(7 - floor(log2 amax)): amax -> [128, 256)."""
    return torch.exp2(7 - torch.floor(torch.log2(amax.clamp_min(1e-30))))


def _fp8(y, pieces: int = 2):
    """FP8 E4M3 rounding of an already normalised y (|y| < 256) in ``pieces`` pieces: hi = fp8(y), then fp8 of
    what is left (``foscar.blackwell.primitives.fp8_pieces``), summed."""
    total = torch.zeros_like(y)
    for _ in range(pieces):
        total = total + (y - total).to(torch.float32).to(torch.float8_e4m3fn).to(torch.float64)
    return total


def _per_token(params, group, length):
    """Channel-wise params [b, h, L/G, D] -> per token [b, h, L, D]."""
    return params.double().repeat_interleave(group, dim=2)[:, :, :length]


def emulate_kernel(q, cache, sm_scale, pieces=None, step=128):
    """Float64 emulation of the sm_100a kernel, all four folding cases: exact FP4/FP8 KV operands,
    FP8 (hi/lo) B operands with the kernel's power-of-two normalisations (Q per row; Q*s per row
    and channel-wise K group; P*s per step and token-wise V block; P*2^7 for channel-wise V), in
    the kernel config's pieces (``fp8_piece_options``: hi/lo, four for FP16 q), or ``pieces``."""
    from foscar.blackwell.kernel import BlackwellConfig

    scheme = cache.scheme
    pieces = pieces or BlackwellConfig(scheme, cache.page_size, True).PIECES
    d, r = scheme.head_dim, scheme.gqa_ratio
    plan = scheme.plan("sm_100a")  # K and V each with the construction of its own bits
    ka, va = float(plan.k.construction.a), float(plan.v.construction.a)
    kc, ks, kz, _ = cache.codes_and_params("k")
    vc, vs, vz, _ = cache.codes_and_params("v")
    kz, vz = plan.k.offsets(ks.double(), kz), plan.v.offsets(vs.double(), vz)  # a scale-only format's: k * scale
    kop, vop = plan.k.construction.operand(kc), plan.v.construction.operand(vc)  # [b, h, L, D]
    b, hkv, L = kc.shape[:3]
    qg = q.double().reshape(b, hkv, r, d)
    sq = _pow2_norm(qg.abs().amax(-1, keepdim=True))  # [b, h, r, 1]
    if scheme.k.axis.value == "token":
        gk = scheme.k.group
        qr = _fp8(qg * sq, pieces) / sq
        blocks = torch.einsum("bhrjd,bhljd->bhrlj", qr.reshape(b, hkv, r, d // gk, gk), kop.reshape(b, hkv, L, d // gk, gk))
        s = torch.einsum("bhrlj,bhlj->bhrl", blocks, ks.double() / ka)
        s = s + torch.einsum("bhlj,bhrj->bhrl", kz.double(), qg.reshape(b, hkv, r, d // gk, gk).sum(-1))
    else:
        ksl, kzl = _per_token(ks, scheme.k.group, L), _per_token(kz, scheme.k.group, L)
        norm = torch.exp2(-(torch.floor(torch.log2(ksl.abs().amax(-1, keepdim=True).clamp_min(1e-30))) + 1))  # [b,h,L,1]
        qs = (qg * sq)[:, :, :, None, :] * (ksl * norm)[:, :, None]  # [b, h, r, L, D], |.| < 256
        qr = _fp8(qs, pieces) / (sq[:, :, :, None] * norm[:, :, None])
        s = torch.einsum("bhrld,bhld->bhrl", qr, kop) / ka + torch.einsum("bhld,bhrd->bhrl", kzl, qg)
    s = s * sm_scale
    valid = torch.arange(L)[None, :] < cache.lengths.long()[:, None]
    s = s.masked_fill(~valid[:, None, None, :], -torch.inf)
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    out = torch.zeros_like(qg)
    for st in range(0, L, step):
        sl = slice(st, st + step)
        if scheme.v.axis.value == "token":
            gv = scheme.v.group
            for j in range(d // gv):
                vsj = vs[:, :, sl, j].double()
                ps = _pow2_norm(vsj.abs().amax(-1))[:, :, None, None]  # per step and block j
                psr = _fp8(p[..., sl] * vsj[:, :, None] * ps, pieces) / ps
                cols = slice(j * gv, (j + 1) * gv)
                out[..., cols] += torch.einsum("bhrl,bhld->bhrd", psr, vop[:, :, sl, cols]) / va
                out[..., cols] += torch.einsum("bhrl,bhl->bhr", p[..., sl], vz[:, :, sl, j].double())[..., None]
        else:
            vsl, vzl = _per_token(vs, scheme.v.group, L)[:, :, sl], _per_token(vz, scheme.v.group, L)[:, :, sl]
            pr = _fp8(p[..., sl] * 128, pieces) / 128
            out += torch.einsum("bhrl,bhld->bhrd", pr, vop[:, :, sl] * vsl) / va + torch.einsum("bhrl,bhld->bhrd", p[..., sl], vzl)
    l = p.sum(-1, keepdim=True)
    return (out / l).reshape(q.shape), (m.squeeze(-1) + torch.log(l.squeeze(-1))).reshape(q.shape[:2])


# (K bits, V bits): uniform, and mixed (FP8 K operands with FP4 V operands, and the reverse)
BIT_PAIRS = [(2, 2), (4, 4), (4, 2), (2, 4)]
EMULATED = [(kb, vb, k, v) for kb, vb in BIT_PAIRS for k in ("token", "channel") for v in ("token", "channel")]


@pytest.mark.parametrize("k_bits,v_bits,k_axis,v_axis", EMULATED, ids=[f"k{kb}v{vb}-k{k[0]}-v{v[0]}" for kb, vb, k, v in EMULATED])
def test_fp8_hilo_accuracy_emulation(k_bits, v_bits, k_axis, v_axis, rng):
    """FP8 Q/P alone (3-bit mantissa) vs hi/lo split (two FP8 halves, one MMA with 2N columns):
    the split brings the error to the BF16 PyTorch level in every folding case, with K and V bits
    chosen independently."""
    from foscar.quantize import quantize_kv
    from foscar.reference import attend_dequantized, attend_dequantized_torch, attend_folded

    scheme = Scheme.make(k=k_axis, k_group=64, v=v_axis, v_group=128 if v_axis == "token" else 32, head_dim=128,
                         gqa_ratio=4, k_bits=k_bits, v_bits=v_bits)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    k = torch.randn(2, 2, 512, 128, dtype=torch.bfloat16) + 2 * torch.randn(128, dtype=torch.bfloat16)
    v = torch.randn(2, 2, 512, 128, dtype=torch.bfloat16)
    cache = quantize_kv(k, v, scheme, page_size=128, lengths=torch.tensor([512, 300]))
    q = torch.randn(2, 8, 128, dtype=torch.bfloat16)
    sm = 128**-0.5
    ref, ref_lse = attend_dequantized(q, cache, sm)
    folded, _ = attend_folded(q, cache, sm, "sm_100a")
    assert (folded - ref).abs().max() < 1e-9  # the plan with the Blackwell construction is exact
    out, lse = emulate_kernel(q, cache, sm)
    err_hilo = (out - ref).abs().max().item()
    err_fp8 = (emulate_kernel(q, cache, sm, pieces=1)[0] - ref).abs().max().item()
    err_bf16 = (attend_dequantized_torch(q, cache, sm).double() - ref).abs().max().item()
    print(f"{scheme.name}: max|err| hi/lo FP8 {err_hilo:.2e}, single FP8 {err_fp8:.2e}, BF16 torch {err_bf16:.2e}")
    assert err_hilo <= 2 * err_bf16 + 1e-3
    assert (lse - ref_lse).abs().max() < 1e-2
    assert err_fp8 > 2 * err_hilo


FP16_EMULATED = [(2, "token", "token"), (2, "token", "channel"), (2, "channel", "token"), (4, "channel", "channel")]


@pytest.mark.parametrize("bits,k_axis,v_axis", FP16_EMULATED,
                         ids=[f"int{b}-k{k[0]}-v{v[0]}" for b, k, v in FP16_EMULATED])
def test_fp16_queries_take_four_fp8_pieces(bits, k_axis, v_axis, rng):
    """FP16 q has 11 significant bits, hi + lo FP8 carry 8: with hi/lo only, token-wise K turned Q's rounding into a
    shift of every score (K's channel means) that moved the lse by up to ~1.5e-2, and token-wise V's P' put outputs
    up to 1.5x past the rule of an FP16 computation (benchmarks/NOTES.md section 53).
    The kernel takes four pieces of Q' and P' for FP16 (``fp8_piece_options``): within the FP16 rule, lse included,
    on fresh draws."""
    from foscar.blackwell.kernel import BlackwellConfig
    from foscar.reference import attend_dequantized
    from foscar.testing import check_output, random_problem

    scheme = Scheme.make(bits, k_axis, 128, v_axis, 128, 128, 4, q_dtype=torch.float16)
    assert BlackwellConfig(scheme, 128, True).PIECES == 4
    assert BlackwellConfig(dataclasses.replace(scheme, q_dtype=torch.bfloat16), 128, True).PIECES == 2
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    q, cache = random_problem(scheme, (700, 1500), page_size=128, device="cpu", layout="blackwell", shuffle=False)
    sm = scheme.head_dim**-0.5
    out, lse = emulate_kernel(q, cache, sm)
    acc = check_output(out.to(torch.float16).reshape(q.shape), lse, q, cache, sm)
    assert acc.ok, acc
    if k_axis == "token":  # hi/lo alone: the lse shift (4e-3 to 1.5e-2 in 42 draws, four pieces <= 7e-5: section 53)
        _, lse_hilo = emulate_kernel(q, cache, sm, pieces=2)
        assert (lse_hilo - attend_dequantized(q, cache, sm)[1]).abs().max() > 10 * acc.lse_err


def test_four_pieces_fall_back_to_hi_lo_where_the_tmem_is_short():
    """head_dim 256 in token-wise K groups of 32 (8 S accumulators of 16 query columns): four pieces need 640 TMEM
    columns, so FP16 keeps hi/lo there."""
    from foscar.blackwell.kernel import BlackwellConfig

    scheme = Scheme.make(2, "token", 32, "token", 32, 256, 16, q_dtype=torch.float16)
    cfg = BlackwellConfig(scheme, 128, False)
    assert cfg.PIECES == 2 and cfg.NM == 2 * cfg.N


# ------------------------------------------------------------------------------------ compile (CPU)
# (bits, k axis, k group, v axis, v group, head_dim, gqa_ratio, page_size, partial_output); bits is
# one int for both tensors or (K bits, V bits)
VARIANTS = [
    (2, "token", 128, "token", 128, 128, 4, 64, False),
    (4, "token", 128, "token", 128, 128, 4, 64, False),
    (2, "channel", 128, "token", 128, 128, 4, 128, False),
    (4, "token", 64, "channel", 64, 128, 5, 256, True),
    (2, "token", 64, "token", 64, 64, 7, 64, False),
    (4, "channel", 64, "channel", 64, 64, 2, 128, False),
    (2, "channel", 64, "channel", 64, 256, 2, 128, False),
    (4, "token", 64, "token", 32, 256, 7, 128, False),  # spilled 16 B before the operand/TMEM stages
    (4, "token", 256, "token", 256, 256, 7, 64, False),  # idem
    (2, "token", 32, "token", 32, 256, 16, 128, False),  # spilled 8 B (was 544 B of hoisted MMA descriptors)
    (4, "channel", 32, "channel", 32, 128, 16, 64, True),  # spilled 16 B live across the role dispatch
    (2, "channel", 128, "token", 128, 128, 16, 128, True),  # spilled 8 B live across the role dispatch
    # K and V bits chosen independently: every fold case pair, FP8 K with FP4 V and the reverse
    ((4, 2), "token", 128, "token", 128, 128, 4, 128, False),
    ((4, 2), "token", 64, "channel", 64, 128, 5, 256, True),
    ((4, 2), "channel", 64, "token", 64, 128, 6, 128, True),
    ((4, 2), "channel", 32, "channel", 32, 64, 2, 64, False),
    ((2, 4), "token", 32, "token", 32, 128, 8, 64, True),
    ((2, 4), "token", 128, "channel", 128, 128, 4, 128, False),
    ((2, 4), "channel", 128, "token", 128, 128, 16, 128, True),
    ((2, 4), "channel", 64, "channel", 64, 256, 2, 128, False),
]


def _scheme(variant) -> Scheme:
    bits, ka, kg, va, vg, d, r = variant[:7]
    k_bits, v_bits = bits if isinstance(bits, tuple) else (bits, bits)
    return Scheme.make(k=ka, k_group=kg, v=va, v_group=vg, head_dim=d, gqa_ratio=r, k_bits=k_bits, v_bits=v_bits)


def _ids(v):
    bits = f"k{v[0][0]}v{v[0][1]}" if isinstance(v[0], tuple) else f"int{v[0]}"
    return f"{bits}-k{v[1][0]}{v[2]}-v{v[3][0]}{v[4]}-d{v[5]}-r{v[6]}-p{v[7]}{'-split' if v[8] else ''}"


CONSTRUCTION_MASKS = {2: "0x33333333", 4: "0xf0f0f0f"}  # LOP3 immediates of the FP4 / FP8 recipes


# The exact PTX counts below (MMAs, bulk copies, fences, ...) follow from the kernel's structure as
# nvidia-cutlass-dsl 4.8.1 (pinned in pyproject.toml) emits it; a DSL upgrade may change them.
def _check_compiled(scheme, ps, partial):
    from foscar.blackwell.decode import KERNELS
    from foscar.blackwell.kernel import BlackwellConfig
    from foscar.inspect import artifacts

    compiled = KERNELS.compile_decode(scheme, ps, partial)
    ptx = compiled.__ptx__
    ptx = open(ptx).read() if "\n" not in ptx else ptx
    assert ".target sm_100a" in ptx
    cfg = BlackwellConfig(scheme, ps, partial)
    n_mma = len(re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f8f6f4", ptx))
    pv_kblocks = sum(end - first for first, end in map(cfg.vh.pv_kblocks, range(cfg.JPM)))
    assert n_mma == cfg.KB_D + cfg.MT * pv_kblocks, n_mma
    assert "tcgen05.alloc" in ptx and "tcgen05.ld" in ptx and "tcgen05.commit" in ptx and "tcgen05.dealloc" in ptx
    assert len(re.findall(r"setmaxnreg\.(inc|dec)", ptx)) == 4 and ".minnctapersm" in ptx
    # producer warp: one 1-D bulk copy per tile part (K codes, V codes, K params, V params; channel-wise
    # V params reach the output warpgroup through the softmax's sVp copy, not from global memory)
    n_bulk = len(re.findall(r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes", ptx))
    assert n_bulk == 4, n_bulk
    assert "mbarrier.arrive.expect_tx" in ptx
    # mbarrier handoffs: ring, operands, S, P, statistics, O (full + empty each, 12 arrays)
    assert len(re.findall(r"mbarrier\.init", ptx)) >= 12
    assert len(re.findall(r"mbarrier\.try_wait\.parity", ptx)) >= 12
    assert len(re.findall(r"tcgen05\.commit", ptx)) == 4  # S full, O full, P empty, operands empty
    # proxy and TMEM ordering: fence.proxy.async after the prep and softmax smem writes, tcgen05
    # fences around the mbarrier handoffs, a tcgen05.wait::ld per tcgen05.ld
    assert len(re.findall(r"fence\.proxy\.async", ptx)) >= 2
    assert len(re.findall(r"tcgen05\.fence::after_thread_sync", ptx)) == 4
    assert len(re.findall(r"tcgen05\.fence::before_thread_sync", ptx)) == 2
    assert len(re.findall(r"tcgen05\.wait::ld", ptx)) == len(re.findall(r"tcgen05\.ld\.", ptx))
    art = artifacts(compiled)
    # the preparation warpgroup builds each tensor with the recipe of its own bits
    sass = art.sass.lower()
    for bits in {scheme.k.bits, scheme.v.bits}:
        assert CONSTRUCTION_MASKS[bits] in sass, (scheme.name, bits)
    for bits in set(CONSTRUCTION_MASKS) - {scheme.k.bits, scheme.v.bits}:
        assert CONSTRUCTION_MASKS[bits] not in sass, (scheme.name, bits)
    return art.resources()


@pytest.mark.sass
@pytest.mark.parametrize("variant", VARIANTS, ids=[_ids(v) for v in VARIANTS])
def test_compiles_for_sm100a_with_tcgen05(variant):
    pytest.importorskip("cutlass")
    res = _check_compiled(_scheme(variant), variant[7], variant[8])
    print(f"{_ids(variant)}: {res.registers} registers, {res.local_bytes} B local")
    assert res.local_bytes == 0


FP16_COMPILED = [VARIANTS[0], VARIANTS[11]]  # token-wise K (N = 8: 32 B columns), channel-wise K (N = 16: 64)


@pytest.mark.sass
@pytest.mark.parametrize("variant", FP16_COMPILED, ids=[_ids(v) for v in FP16_COMPILED])
def test_fp16_queries_compile_with_four_pieces(variant):
    """FP16 q: Q' and P' in four FP8 pieces (4N B columns), the same MMAs, copies and handoffs, no spills."""
    from foscar.blackwell.kernel import BlackwellConfig

    scheme = dataclasses.replace(_scheme(variant), q_dtype=torch.float16)
    cfg = BlackwellConfig(scheme, variant[7], variant[8])
    assert cfg.PIECES == 4 and cfg.NM == 4 * cfg.N and cfg.NQK == cfg.kh.q_copies * cfg.NM
    assert _check_compiled(scheme, variant[7], variant[8]).local_bytes == 0


def test_mixed_bits_config_reads_the_plan_per_tensor():
    """K4V2: the ring holds an INT4 K tile and an INT2 V tile, the MMAs take FP8 K and FP4 V operands,
    and each tensor's scale factor is its own construction's 1/a."""
    from cutlass import Float4E2M1FN, Float8E4M3FN

    from foscar.blackwell.kernel import BlackwellConfig

    scheme = Scheme.make(k="channel", k_group=64, v="token", v_group=128, head_dim=128, gqa_ratio=4, k_bits=4, v_bits=2)
    cfg = BlackwellConfig(scheme, 128, False)
    assert (cfg.K_TW, cfg.V_TW) == (64 * 128 * 4 // 32, 64 * 128 * 2 // 32)
    assert (cfg.k_op.mma_dtype, cfg.v_op.mma_dtype) == (Float8E4M3FN, Float4E2M1FN)
    assert (cfg.k_a_inv, cfg.v_a_inv) == (512.0, 2.0)
    plan = scheme.plan("sm_100a")
    assert (cfg.KPW, cfg.VPW) == (plan.k.tile_param_words, plan.v.tile_param_words)
    assert cfg.STAGE_WORDS == cfg.K_TW + cfg.V_TW + cfg.KPW + cfg.VPW


@pytest.mark.slow
@pytest.mark.sass
def test_whole_coverage_matrix_compiles_for_sm100a():
    """Every (scheme, page size) of foscar.testing.coverage_matrix(), split and not."""
    pytest.importorskip("cutlass")
    from foscar.testing import coverage_matrix

    spills = {}
    for scheme, ps, _lengths in coverage_matrix("sm_100a"):
        for partial in (False, True):
            res = _check_compiled(scheme, ps, partial)
            if res.local_bytes:
                spills[f"{scheme.name}-p{ps}{'-split' if partial else ''}"] = res.local_bytes
    print("spilling:", spills)
    assert not spills, spills


def _prep_loop(k_bits, v_bits):
    """Instructions of the preparation warpgroup's loop (the one loop holding the construction masks
    of both tensors) of the Blackwell decode kernel, head_dim 128, 128-token steps."""
    from foscar.blackwell.decode import KERNELS
    from foscar.inspect import artifacts, loop_regions, parse_instructions

    scheme = Scheme.make(head_dim=128, gqa_ratio=4, k_bits=k_bits, v_bits=v_bits)
    art = artifacts(KERNELS.compile_decode(scheme, 64, False))
    sass = art.sass_by_kernel[art.kernel()]
    ins, _ = parse_instructions(sass)
    masks = {CONSTRUCTION_MASKS[k_bits], CONSTRUCTION_MASKS[v_bits]}
    loops = [(a, e) for a, e in loop_regions(sass)
             if all(any(a <= i.address <= e and m in i.text.lower() for i in ins) for m in masks)]
    assert loops, "no loop holds the construction masks"
    a, e = min(loops, key=lambda x: x[1] - x[0])
    return [i for i in ins if a <= i.address <= e]


PREP_ELEMENTS = 2 * 128 * 128 // 128  # K and V elements per prep thread per 128-token step (head_dim 128)
ALU_BOUND = {2: 0.25, 4: 0.45}  # LOP3 + SHF per element of one tensor; measured (DSL 4.8.1): 0.22, 0.41


# SASS counts and bounds below were measured with nvidia-cutlass-dsl 4.8.1 (pinned in
# pyproject.toml) and its ptxas; a DSL upgrade may change the code and needs a re-measurement.
@pytest.mark.sass
@pytest.mark.parametrize("bits", [2, 4])
def test_recipe_is_three_alu_ops_per_word(bits):
    """Counted in SASS: per packed word one LOP3 (lo = w & M), one SHF.R by the code width and one
    LOP3 (hi = (w >> shift) & M), i.e. 3 ALU instructions per 16 (INT2) or 8 (INT4) operand elements."""
    pytest.importorskip("cutlass")
    tile = BlackwellTile("k", bits, 128)
    body = _prep_loop(bits, bits)
    words = PREP_ELEMENTS // tile.elems_per_word
    mask_lop3 = sum(i.base == "LOP3" and hex(tile.mask) in i.text.lower() for i in body)
    shifts = sum(i.opcode.startswith("SHF.R") and f", {hex(tile.shift)}," in i.text.lower() for i in body)
    assert (mask_lop3, shifts) == (2 * words, words)


@pytest.mark.sass
@pytest.mark.parametrize("k_bits,v_bits", BIT_PAIRS, ids=[f"k{k}v{v}" for k, v in BIT_PAIRS])
def test_prep_loop_alu_per_element(k_bits, v_bits):
    """SASS of the preparation loop: LOP3 + SHF per KV element (paper: 0.19 per INT2 element on B200);
    a mixed scheme pays each tensor's own recipe (half the elements each)."""
    pytest.importorskip("cutlass")
    from collections import Counter

    mix = Counter(i.base for i in _prep_loop(k_bits, v_bits))
    construction = (mix["LOP3"] + mix["SHF"]) / PREP_ELEMENTS
    print(f"k{k_bits}v{v_bits}: prep loop {dict(mix)}; LOP3+SHF per element {construction:.3f}")
    assert construction <= (ALU_BOUND[k_bits] + ALU_BOUND[v_bits]) / 2


# ------------------------------------------------------------------------------------ GPU (sm_100 only)
def _is_sm100():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


@pytest.mark.gpu
@pytest.mark.skipif(not _is_sm100(), reason="needs an sm_100 (Blackwell) GPU; this kernel is compile-verified only elsewhere")
@pytest.mark.parametrize("scheme, page_size, lengths", coverage_matrix("sm_100a"), ids=lambda p: getattr(p, "name", None))
def test_blackwell_decode_matches_reference_on_sm100(scheme, page_size, lengths):
    from foscar.decode import decode
    from foscar.testing import check_output, random_problem

    q, cache = random_problem(scheme, lengths, page_size=page_size, layout="blackwell")
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=q.device)
    decode(q, cache, return_lse=True, out=out, lse=lse)
    acc = check_output(out, lse, q, cache, scheme.head_dim**-0.5)
    assert acc.ok, acc


CACHE_VARIANTS = [VARIANTS[i] for i in (0, 2, 3, 9, 12, 18)]  # both bit widths and orders, every fold case


@pytest.mark.sass
@pytest.mark.parametrize("variant", CACHE_VARIANTS, ids=[_ids(v) for v in CACHE_VARIANTS])
def test_cache_decode_compiles_for_sm100a(variant):
    """PagedKVCache's decode launch on Blackwell (foscar.blackwell.cache_decode): the decode CTA's roles
    unchanged (the same MMAs, bulk copies and commits as the split-output decode kernel), the
    sequence read in place (64-bit loads of its row and token count), no spills. Compile-verified
    only: no Blackwell GPU runs it here."""
    from foscar.archs import BLACKWELL
    from foscar.inspect import artifacts

    scheme, page_size = _scheme(variant), variant[7]
    cache = artifacts(BLACKWELL.compile_cache_decode(scheme, page_size))
    decode = artifacts(BLACKWELL.compile_decode(scheme, page_size, partial_output=True))
    for pattern in (r"tcgen05\.mma\.cta_group::1\.kind::f8f6f4", r"cp\.async\.bulk\.shared::cluster", r"tcgen05\.commit",
                    r"setmaxnreg\.(inc|dec)"):
        assert len(re.findall(pattern, cache.ptx)) == len(re.findall(pattern, decode.ptx)) > 0, pattern
    assert re.search(r"ld\.global\.(u|b|s)64", cache.ptx)  # seq_rows[b], seq_lengths[row]
    assert cache.resources().local_bytes == 0


def test_every_k_fold_softmax_waits_for_the_prep_of_its_step():
    """The softmax reads what the prep warpgroup wrote (token-wise K: sQinfo of the prologue; channel-wise K: sKinfo
    of the step) after that step's operand ``full`` barrier, in every K fold case, not through the MMA warp's commit
    alone (NOTES 49: whether a tcgen05.commit arrive carries what the MMA thread acquired is unsaid in the PTX ISA)."""
    from foscar.blackwell.folds import HOOKS, KHooks
    from foscar.folds import KFold

    class Channel:
        def __init__(self):
            self.waited = []

        def wait_full(self, item):
            self.waited.append(item)

    k_cases = [case for case in HOOKS.classes if issubclass(case, KFold)]
    assert len(k_cases) >= 2
    for case in k_cases:
        hooks = HOOKS.classes[case]
        assert issubclass(hooks, KHooks)
        opnd = Channel()
        hooks.softmax_wait(object.__new__(hooks), opnd, 5)
        assert opnd.waited == [5], case.__name__
