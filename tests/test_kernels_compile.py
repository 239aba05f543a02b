"""The standalone kernels compile for sm_90a and sm_100a on a CPU machine, with the loads we expect."""

import re

import pytest

from foscar.inspect import ARCHS, artifacts
from foscar.kernels import DequantizeConfig, compile_combine, compile_dequantize
from foscar.split_merge import BATCH
from foscar.scheme import Scheme

DEQUANT_CONFIGS = [
    DequantizeConfig(2, 128, "k", "token", 128),  # OSCAR-style K
    DequantizeConfig(2, 64, "k", "channel", 32),  # KIVI-style K
    DequantizeConfig(4, 256, "v", "channel", 64),
    # the 2-bit V of a K4V2 scheme
    DequantizeConfig.of(Scheme.make(k="channel", k_group=64, v="token", v_group=32, k_bits=4, v_bits=2), "v"),
]


def _no_local_memory(art):
    assert not re.search(r"\.local\b|ld\.local|st\.local", art.ptx)
    assert art.resources().local_bytes == 0
    mix = art.mix()
    assert mix["LDL"] == 0 and mix["STL"] == 0


@pytest.mark.sass
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg", DEQUANT_CONFIGS, ids=lambda c: f"{c.role}{c.bits}d{c.head_dim}{c.axis.value}{c.group}")
def test_dequantize_compiles(cfg, arch):
    art = artifacts(compile_dequantize(cfg, arch=arch))
    assert art.arch == arch and re.search(rf"^\.target {arch}$", art.ptx, re.M)
    # packed tile: 16-byte (8-byte for the smallest tile) global loads, staged to shared memory;
    # ptx spells an 8-byte vector v2.b32 for sm_90a and b64 for sm_100a
    vec = r"v4\.b32" if cfg.tile_words >= 512 else r"(v2\.b32|b64)"
    assert re.search(rf"ld\.global\.{vec}\s", art.ptx) and re.search(rf"st\.shared\.{vec}\s", art.ptx)
    assert "ld.shared.b32" in art.ptx  # codes gathered through the bit layout
    assert "st.global.v4.b32" in art.ptx  # 8 bf16 per store
    assert "ld.global.v2.b16" in art.ptx or "ld.global.b16" in art.ptx  # fp16 (scale, offset)
    _no_local_memory(art)
    assert art.resources().registers <= 64


@pytest.mark.sass
@pytest.mark.parametrize("arch", ARCHS)
def test_combine_compiles(arch):
    art = artifacts(compile_combine(128, arch))
    assert art.arch == arch and re.search(rf"^\.target {arch}$", art.ptx, re.M)
    assert "ld.global.v4.b32" in art.ptx  # 4 fp32 partial-output channels per lane
    assert "st.global.v2.b32" in art.ptx  # 4 bf16 output channels per lane
    assert "ex2.approx" in art.ptx and "lg2.approx" in art.ptx
    _no_local_memory(art)
    # the pass over splits takes BATCH of them per trip: BATCH weights, BATCH lse loads and BATCH
    # 16-byte partial loads (SASS of nvidia-cutlass-dsl 4.8.1, pinned in pyproject.toml: another DSL
    # version may schedule it differently)
    loop = art.loop_mix(full_opcodes=True)
    assert loop["MUFU.EX2"] == BATCH and loop["LDG.E.128"] == BATCH and loop["LDG.E"] == BATCH


@pytest.mark.sass
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("head_dim,gqa,dtype", [(128, 4, "bf16"), (128, 16, "bf16"), (64, 1, "bf16"), (256, 2, "bf16"),
                                                 (256, 16, "bf16"), (128, 7, "bf16"), (128, 4, "f16"),
                                                 (128, 16, "f16")])
def test_sink_window_compiles(head_dim, gqa, dtype, arch):
    """The 16-bit sink + window kernel (PagedKVCache's second launch), BF16 and FP16: 16-byte cp.async
    copies of the K and V rows, zero-filling rows that hold no token, in two groups (no bulk copies: one per
    row made the TMA engine the bottleneck), Tensor Cores in
    the window's type for S^T and O^T (D/16 MMAs each per n8 block of query columns), movmatrix for
    V^T and P^T, the counting atomic and fences of the in-launch merge, no spills."""
    import cutlass

    from foscar.kernels.sink_window import CHUNK, WARPS, compile_sink_window

    art = artifacts(compile_sink_window(head_dim, gqa, arch, cutlass.BFloat16 if dtype == "bf16" else cutlass.Float16))
    assert art.arch == arch and re.search(rf"^\.target {arch}$", art.ptx, re.M)
    assert "cp.async.bulk" not in art.ptx
    copies = 2 * CHUNK * (head_dim // 8) // (32 * WARPS)  # 16-byte pieces of a chunk's K and V rows per thread
    assert len(re.findall(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16, %r\d+;", art.ptx)) == copies
    assert art.ptx.count("cp.async.commit_group") == 2 and re.search(r"cp\.async\.wait_group\s+1;", art.ptx)
    n_blocks = 1 if gqa <= 8 else 2
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32"
    assert art.ptx.count(mma) == 2 * (head_dim // 16) * n_blocks
    assert f"cvt.rn.{dtype}x2.f32" in art.ptx  # P packed in the window's type
    assert art.ptx.count("movmatrix.sync.aligned.m8n8.trans.b16") == 4 * (head_dim // 16) + 2 * n_blocks
    assert "atom.global.acq_rel.add.u32" in art.ptx  # the count (gpu scope: atom's default)
    assert art.ptx.count("fence.acq_rel.gpu") == 2  # release before the count, acquire before the merge
    _no_local_memory(art)


def test_window_shared_rows_are_conflict_free():
    """The fragment reads of the padded K / V rows of the 16-bit window (``foscar.window_tiles``:
    ``WindowOperands.row_word``, for the window kernel and the Hopper cache decode's window tiles):
    the 8 rows x 4 words of a quarter (lane 4g + tq reads the pair at element 2*tq of row g, plus the
    quarter's offsets) fall on 32 distinct banks at every head_dim."""
    from foscar.window_tiles import ROW_PAD, shared_word_index

    for head_dim in (64, 128, 256):
        for row0, element0 in ((0, 0), (8, 8), (16, 16 * 3)):  # quarters of K (g + 8 h_r) and V^T (8 h_c + g)
            words = {shared_word_index(row0 + g, element0 + 2 * tq, head_dim + ROW_PAD) for g in range(8)
                     for tq in range(4)}
            assert len({w % 32 for w in words}) == 32, (head_dim, row0, element0)


def test_sink_window_limits_name_the_field():
    """Shared memory and slot count are checked before anything launches (PagedKVCache calls this
    when built with kernels), naming the Scheme field or the cache's sink / window."""
    from foscar.kernels.sink_window import check_sink_window, shared_bytes

    for head_dim in (64, 128, 256):
        check_sink_window(head_dim, 16, 448)  # every head_dim with the most query heads per KV head
        assert shared_bytes(head_dim, 16) <= 227 * 1024
    with pytest.raises(ValueError, match="Scheme.gqa_ratio=17"):
        check_sink_window(128, 17, 448)
    with pytest.raises(ValueError, match="Scheme.head_dim=96"):
        check_sink_window(96, 4, 448)
    with pytest.raises(ValueError, match=r"sink \+ window \+ granule \(64 \+ 4096 \+ 64\) = 4224"):
        check_sink_window(128, 4, 4224, "sink + window + granule (64 + 4096 + 64)")
