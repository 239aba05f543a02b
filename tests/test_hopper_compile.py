"""Compile-only checks of the Hopper decode kernel for sm_90a (run on CPU machines, no GPU)."""

import os
import re

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch

pytest.importorskip("cutlass")

from foscar.scheme import Scheme  # noqa: E402

# (bits, k axis, k group, v axis, v group, head_dim, gqa_ratio, page_size, partial_output)
VARIANTS = [
    (2, "token", 128, "token", 128, 128, 4, 64, False),
    (4, "token", 128, "token", 128, 128, 4, 64, False),
    (2, "channel", 64, "token", 128, 128, 4, 64, False),
    (4, "channel", 32, "token", 32, 128, 5, 128, True),
    (2, "token", 32, "channel", 32, 64, 1, 64, False),
    (4, "token", 64, "channel", 128, 256, 16, 128, True),
    (2, "channel", 128, "channel", 64, 128, 7, 128, False),
    ((4, 2), "channel", 128, "token", 128, 128, 4, 128, True),  # K and V bits independent
    ((2, 4), "token", 64, "channel", 64, 128, 8, 128, False),
    ((4, 2), "token", 128, "channel", 32, 128, 3, 64, True),
    ((2, 4), "channel", 64, "token", 32, 128, 16, 128, False),
]


def _scheme(bits, ka, kg, va, vg, d, r):
    k_bits, v_bits = bits if isinstance(bits, tuple) else (bits, bits)
    return Scheme.make(k=ka, k_group=kg, v=va, v_group=vg, head_dim=d, gqa_ratio=r, k_bits=k_bits, v_bits=v_bits)


def _ids(v):
    bits = f"k{v[0][0]}v{v[0][1]}" if isinstance(v[0], tuple) else f"int{v[0]}"
    return f"{bits}-k{v[1][0]}{v[2]}-v{v[3][0]}{v[4]}-d{v[5]}-r{v[6]}-p{v[7]}{'-split' if v[8] else ''}"


@pytest.mark.parametrize("variant", VARIANTS, ids=[_ids(v) for v in VARIANTS])
def test_compiles_with_warp_mma(variant):
    from foscar.hopper.decode import KERNELS
    from foscar.hopper.kernel import DecodeConfig, default_consumers

    bits, ka, kg, va, vg, d, r, ps, partial = variant
    scheme = _scheme(bits, ka, kg, va, vg, d, r)
    compiled = KERNELS.compile_decode(scheme, ps, partial)
    ptx = compiled.__ptx__
    assert ".target sm_90a" in ptx
    cfg = DecodeConfig(scheme, ps, partial, default_consumers(scheme))
    n = len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32", ptx))
    # No wgmma: the warps own whole tiles.
    data, k_bias, v_bias = mma_counts(cfg)
    # the tile's code once in the loop's body, once more in a pipelined loop's first front and last back, and once
    # per masked tile after the loop; a token-wise K cancels its bias once per CTA, a channel-wise one per tile
    per_tile, once = (data + v_bias, k_bias) if scheme.k.axis.value == "token" else (data + v_bias + k_bias, 0)
    copies = 1 + cfg.PIPELINED + cfg.MASKED_TILES
    assert n == copies * per_tile + once, (n, data, k_bias, v_bias, cfg.PIPELINED, cfg.MASKED_TILES)
    assert "wgmma" not in ptx
    assert "movmatrix.sync.aligned.m8n8.trans.b16" in ptx  # P^T from the S^T accumulator, in registers
    # warp specialization: registers move producer -> consumers; the producer's 1-D bulk copies
    assert "setmaxnreg.dec.sync.aligned.u32" in ptx and "setmaxnreg.inc.sync.aligned.u32" in ptx
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    assert "mbarrier.try_wait.parity" in ptx


def mma_counts(cfg):
    """mma.sync per tile (QK: token block x k16 channel block, PV: m16 channel block x k16 token block,
    per n8 block of query columns), then the operand-bias MMAs (constant A): K once per scaled Q^T
    (token-wise: once per CTA; channel-wise: per token group of a tile), V per tile and n8 block
    (token-wise: per channel group)."""
    from foscar.hopper.mma import TOKEN_BLOCKS

    data = (TOKEN_BLOCKS * cfg.KB_D + cfg.MB_V * TOKEN_BLOCKS) * cfg.NB
    k, v = cfg.plan.k, cfg.plan.v
    k_bias = cfg.KB_D * cfg.NB * (1 if k.token_wise else k.tile_groups)
    v_bias = TOKEN_BLOCKS * cfg.NB * (v.channel_blocks if v.token_wise else 1)
    return data, k_bias, v_bias


# (variant, bound): shift/logic SASS instructions (LOP3, SHF, IMAD.SHL, PRMT) of the main loop per
# K/V element a consumer thread handles (2*64*D/32 per 64-token tile: one warp owns the tile).
# Measured in benchmarks/NOTES.md; the bound is the measurement plus a small margin, so a
# regression fails. Measured with nvidia-cutlass-dsl 4.8.1 (pinned in pyproject.toml) and its ptxas:
# a DSL upgrade may change the SASS and needs a re-measurement.
LOOP_BOUNDS = [
    # measured (benchmarks/NOTES.md section 44; before the bottom slots' shift left: 0.565, 0.5625, 0.625), K
    # channel-wise with the Q scaling and the unpacking of the 16-bit q at each group's rebuild
    ((2, "channel", 128, "token", 128, 128, 4, 128, True), 0.65),  # measured 0.627
    ((2, "token", 128, "token", 128, 128, 4, 128, True), 0.64),  # measured 0.625: 256 LOP3 + 32 SHF + 32 IMAD.SHL
    ((4, "token", 128, "token", 128, 128, 4, 128, True), 0.77),  # measured 0.750
]


@pytest.mark.sass
@pytest.mark.parametrize("variant, bound", LOOP_BOUNDS, ids=[_ids(v) for v, _ in LOOP_BOUNDS])
def test_main_loop_shift_logic_per_element(variant, bound):
    from foscar.hopper.decode import KERNELS
    from foscar.hopper.kernel import DecodeConfig, default_consumers
    from foscar.inspect import artifacts, is_shift_logic

    bits, ka, kg, va, vg, d, r, ps, partial = variant
    scheme = Scheme.make(bits, k=ka, k_group=kg, v=va, v_group=vg, head_dim=d, gqa_ratio=r)
    loop = artifacts(KERNELS.compile_decode(scheme, ps, partial)).loop_mix(full_opcodes=True)
    data, k_bias, v_bias = mma_counts(DecodeConfig(scheme, ps, partial, default_consumers(scheme)))
    # the consumer's main loop: a channel-wise K scales Q^T (and its bias MMAs) inside it
    in_loop = data + v_bias + (0 if scheme.k.axis.value == "token" else k_bias)
    assert sum(n for op, n in loop.items() if op.startswith("HMMA")) == in_loop
    construction = sum(n for op, n in loop.items() if is_shift_logic(op))
    per_element = construction / (2 * 64 * d // 32)
    assert per_element <= bound, (per_element, sorted(loop.items(), key=lambda x: -x[1])[:12])


def test_compile_cache_hits():
    from foscar.hopper.decode import KERNELS

    scheme = Scheme.make(2, head_dim=128, gqa_ratio=4)
    assert KERNELS.compile_decode(scheme, 64) is KERNELS.compile_decode(scheme, 64)


def test_every_ring_stage_belongs_to_one_consumer_warp():
    """STAGES is a multiple of TPG * NW for every coverage-matrix variant and page size, so a warp
    never waits on a stage's mbarrier parity two phases ahead of its fill (foscar/pipeline.py)."""
    from foscar.hopper.kernel import DecodeConfig, default_consumers
    from foscar.testing import coverage_matrix

    for scheme, page_size, _ in coverage_matrix():
        for consumers in (1, 2, 3, 4):
            try:
                cfg = DecodeConfig(scheme, page_size, True, consumers)
            except ValueError:  # the ring of that many warps does not fit (8-bit codes): never the default
                assert consumers != default_consumers(scheme), (scheme.name, consumers)
                continue
            assert cfg.STAGES % (cfg.TPG * cfg.NW) == 0 and cfg.STAGES >= cfg.TPG * cfg.NW, (scheme.name, consumers)
            assert cfg.STAGES * cfg.STAGE_WORDS * 4 <= 220 * 1024


def test_every_cache_variant_gets_a_ring():
    """PagedKVCache's decode config (foscar/hopper/cache_decode.py) for every variant the kernel takes over
    head_dim x K axis and group x GQA at the page sizes a group allows: its ring keeps the one-owner rule
    and fits; the window tiles share it everywhere but head_dim 256 with channel-wise K groups of 256
    tokens (a warp's run of 4 window-sized stages, 16 in all, exceeds shared memory), which is two launches."""
    from foscar.archs import HOPPER
    from foscar.hopper.cache_decode import cache_decode_config, fuses_window
    from foscar.hopper.kernel import default_consumers

    two_launch = []
    for head_dim in (64, 128, 256):
        for k_axis, k_group in [("token", g) for g in (32, head_dim)] + [("channel", g) for g in (32, 128, 256)]:
            for ratio in (1, 4, 8, 16):
                for page_size in (64, 128, 256):
                    try:
                        scheme = Scheme.make(2, k_axis, k_group, "token", 32, head_dim, ratio)
                        HOPPER.can_implement(scheme, page_size)
                    except ValueError:
                        continue
                    cfg = cache_decode_config(scheme, page_size, default_consumers(scheme))
                    assert cfg.STAGES % (cfg.TPG * cfg.NW) == 0 and cfg.STAGES >= cfg.TPG * cfg.NW, scheme.name
                    assert cfg.STAGES * cfg.STAGE_WORDS * 4 <= 220 * 1024
                    assert fuses_window(scheme, page_size, default_consumers(scheme)) == (cfg.window is not None)
                    if cfg.window is None:
                        two_launch.append((head_dim, k_axis, k_group))
    assert two_launch and set(two_launch) == {(256, "channel", 256)}


def test_cache_decode_without_window_ring_is_two_launches():
    """Where the window tiles do not fit the ring, the cache decode launch is the quantized splits'
    partials only (bulk copies, no window cp.async, no in-launch merge) and the window kernel's limit
    on 16-bit slots applies, named up front; a one-launch variant has no such limit."""
    from foscar.archs import HOPPER
    from foscar.inspect import artifacts

    scheme = Scheme.make(2, "channel", 256, "token", 128, 256, 8)
    ptx = artifacts(HOPPER.compile_cache_decode(scheme, 256)).ptx
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    assert "cp.async.mbarrier.arrive" not in ptx and "atom.global" not in ptx and "shfl.sync.up" not in ptx
    HOPPER.check_cache(scheme, 256, 64 + 256 + 256)
    with pytest.raises(ValueError, match=r"sink \+ window \+ granule \(64 \+ 8192 \+ 256\) = 8512"):
        HOPPER.check_cache(scheme, 256, 8512, "sink + window + granule (64 + 8192 + 256)")
    HOPPER.check_cache(Scheme.make(2, "channel", 128, "token", 128, 256, 8), 256, 8512)


def test_pipeline_probe_compiles_without_compute():
    """benchmarks/pipeline_probe.py: the decode kernel's producer and ring, consumers that only wait
    and release -- bulk copies and mbarrier waits in the PTX, no MMA."""
    from benchmarks.pipeline_probe import compile_pipeline_only

    scheme = Scheme.make(2, "token", 128, "token", 128, 128, 4)
    bulk = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
    # per tile (or page): 4 bulk copies; codes only: 2; mixed: 2 bulk + 16-byte cp.async for V
    for copies, n_bulk, lsu in (("tile", 4, False), ("page", 4, False), ("codes", 2, False), ("mixed", 2, True)):
        ptx = compile_pipeline_only(scheme, copies=copies).__ptx__
        assert ptx.count(bulk) == n_bulk, copies
        assert ("cp.async.cg.shared.global" in ptx and "cp.async.mbarrier.arrive" in ptx) == lsu, copies
        assert "mbarrier.try_wait.parity" in ptx
        assert "mma" not in ptx


CACHE_VARIANTS = [  # (scheme, page size): the cache decode's window tiles over each V case, 1 and 2 n8 blocks, FP16
    (Scheme.make(2, "token", 128, "token", 128, 128, 4), 128),
    (Scheme.make(2, "channel", 128, "token", 128, 128, 4), 128),
    (Scheme.make(4, "token", 128, "channel", 128, 256, 2), 128),
    (Scheme.make(4, "token", 64, "token", 64, 64, 16), 64),
    (Scheme.make(2, "token", 128, "token", 128, 128, 4, torch.float16), 128),
]


@pytest.mark.sass
@pytest.mark.parametrize("scheme,page_size", CACHE_VARIANTS, ids=[f"{s.name}-p{p}" for s, p in CACHE_VARIANTS])
def test_cache_decode_fuses_window_tiles(scheme, page_size):
    """PagedKVCache's decode (foscar/hopper/cache_decode.py) is one launch: the packed tiles' bulk copies and
    FP16 MMAs, and the 16-bit window tiles through the same ring -- cp.async copies of 16 slots' K and
    V rows per producer lane's share, each lane arriving by cp.async.mbarrier.arrive.noinc, and D/16 MMAs
    each for S^T and O^T in the window's type per n8 block -- then the in-launch merge (the counting
    atomic between two fences). No more spills than the plain decode (the producer's copy loop is a
    runtime loop: 40 registers)."""
    from foscar.archs import HOPPER
    from foscar.inspect import artifacts
    from foscar.window_tiles import BLOCK

    art = artifacts(HOPPER.compile_cache_decode(scheme, page_size))
    ptx = art.ptx
    dtype = "bf16" if scheme.q_dtype == torch.bfloat16 else "f16"
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx  # packed tiles
    # each producer lane arrives once its window copies land; a packed tile's producer arrives for all 32
    assert re.search(r"cp\.async\.mbarrier\.arrive\.noinc\.shared(::cta)?\.b64", ptx)
    arrives = [line.strip() for line in ptx.splitlines() if "mbarrier.arrive" in line]
    after_tx = [b for a, b in zip(arrives, arrives[1:]) if a.startswith("mbarrier.arrive.expect_tx")]
    arrive = r"mbarrier\.arrive\.shared\.b64 \S+, \[%r\d+(\+\d+)?\], %r\d+;"
    assert after_tx and all(re.match(arrive, b) for b in after_tx)
    assert "cp.async.bulk.tensor" not in ptx
    # one cp.async per tensor in the producer's runtime copy loop
    assert len(re.findall(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16, %r\d+;", ptx)) == 2
    n_blocks = 1 if scheme.gqa_ratio <= 8 else 2
    window_mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32"
    if dtype == "bf16":  # FP16 windows share the packed tiles' MMA type
        assert ptx.count(window_mma) == 2 * (scheme.head_dim // 16) * n_blocks
    assert ptx.count("movmatrix.sync.aligned.m8n8.trans.b16") >= 4 * (scheme.head_dim // 16) + 2 * n_blocks
    # the split merge's release and acquire fences, one pair per level (foscar.split_merge: two past 16 parts)
    assert "atom.global.acq_rel.add.u32" in ptx and ptx.count("fence.acq_rel.gpu") == 4
    assert ptx.count("shfl.sync.up.b32") >= 10  # the work list: two block-wide scans of 5 steps (foscar.work_list)
    assert BLOCK == 16
    # the window tiles add no spill to the decode's (some variants spill a few words with 3 warpgroups), but for
    # 16 bytes: INT4 d64 gqa16's window state spills 16 where its plain decode spills 8 (both 80 before the V
    # token-wise fold cancelled the bias per tile, benchmarks/NOTES.md section 30)
    plain = artifacts(HOPPER.compile_decode(scheme, page_size, True))
    assert art.resources().local_bytes <= max(plain.resources().local_bytes, 16)
