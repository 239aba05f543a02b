"""Compile-only checks of the Hopper decode kernel for sm_90a (run on CPU machines, no GPU)."""

import os
import re

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest

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
]


def _ids(v):
    return f"int{v[0]}-k{v[1][0]}{v[2]}-v{v[3][0]}{v[4]}-d{v[5]}-r{v[6]}-p{v[7]}{'-split' if v[8] else ''}"


@pytest.mark.parametrize("variant", VARIANTS, ids=[_ids(v) for v in VARIANTS])
def test_compiles_with_wgmma(variant):
    from foscar.hopper.decode import compile_decode
    from foscar.hopper.kernel import DecodeConfig

    bits, ka, kg, va, vg, d, r, ps, partial = variant
    scheme = Scheme.make(bits, k=ka, k_group=kg, v=va, v_group=vg, head_dim=d, gqa_ratio=r)
    compiled = compile_decode(scheme, ps, partial, arch="sm_90a")
    ptx = compiled.__ptx__
    assert ".target sm_90a" in ptx
    cfg = DecodeConfig(scheme, ps, partial)
    n = len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.f16\.f16", ptx))
    # QK: one MMA per k16 block and K accumulator; PV: per m64 channel tile, V accumulator, k16 block
    qk = cfg.KB_D * (cfg.NGK if not cfg.k_token else 1)
    pv = cfg.MT_V * cfg.KB_T * (max(1, 64 // cfg.GV) if cfg.v_token else 1)
    assert n == qk + pv, (n, qk, pv)
    assert f"m64n{cfg.N}k16" in ptx
    assert "setmaxnreg" in ptx or not getattr(cfg, "warp_specialized", False)


def test_compile_cache_hits():
    from foscar.hopper.decode import compile_decode

    scheme = Scheme.make(2, head_dim=128, gqa_ratio=4)
    assert compile_decode(scheme, 64) is compile_decode(scheme, 64)
