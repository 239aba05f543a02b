"""The CuTe DSL quantize kernel: its layout inverse (CPU), its compile for both arches (CPU), and
bit-identity with the torch quantizer ``quantize_groups`` + ``pack_tiles`` (GPU)."""

import itertools
import re

import pytest
import torch

from foscar.inspect import ARCHS, artifacts
from foscar.kernels.quantize import QuantizeConfig, bw_word_code_coords, compile_quantize, word_code_coords
from foscar.layouts import PACKERS, TILE_TOKENS, TileGeometry, tile_position
from foscar.layouts.blackwell import bw_tile_position
from foscar.quantize import quantize_groups, stack_params
from foscar.scheme import Axis, Scheme, TensorQuant

GEOMETRIES = [TileGeometry(role, bits, d) for role, bits, d in itertools.product(("k", "v"), (2, 4, 8), (64, 128, 256))]

CASES = [  # (scheme, role)
    (Scheme.make(2, "token", 128, "token", 128, 128), "k"),  # OSCAR K
    (Scheme.make(2, "channel", 128, "token", 32, 128), "k"),  # KIVI K
    (Scheme.make(2, "channel", 128, "token", 32, 128), "v"),  # KIVI V, next to a 128-token K granule
    (Scheme.make(4, "token", 64, "channel", 64, 64), "v"),
    (Scheme.make(4, "token", 64, "channel", 256, 256, q_dtype=torch.float16), "k"),
    # K and V of different widths: each tensor its own bits, one granule (the 128-token K group's)
    (Scheme.make(k="channel", k_group=128, v="token", v_group=64, k_bits=4, v_bits=2), "k"),
    (Scheme.make(k="channel", k_group=128, v="token", v_group=64, k_bits=4, v_bits=2), "v"),
    (Scheme.make(k="token", k_group=32, v="channel", v_group=64, k_bits=2, v_bits=4), "k"),
    (Scheme.make(k="token", k_group=32, v="channel", v_group=64, k_bits=2, v_bits=4), "v"),
    # 8-bit codes (the INT8 of tests/user_formats.py, registered by conftest): two registers' codes per word
    (Scheme.make(8, "channel", 128, "token", 128, 128), "k"),
    (Scheme.make(8, "channel", 128, "token", 128, 128), "v"),
]
CONFIGS = [QuantizeConfig.of(scheme, role) for scheme, role in CASES]
COMPILED = CONFIGS[:3] + CONFIGS[6:7] + [  # + the 2-bit V of a K4V2 scheme, + Blackwell's bit order
    QuantizeConfig.of(CASES[0][0], "k", "blackwell"), QuantizeConfig.of(CASES[3][0], "v", "blackwell")]


@pytest.mark.parametrize("geom", GEOMETRIES, ids=lambda g: f"{g.role}{g.bits}d{g.head_dim}")
@pytest.mark.parametrize("coords,position", [(word_code_coords, tile_position), (bw_word_code_coords, bw_tile_position)],
                         ids=["hopper", "blackwell"])
def test_word_code_coords_inverts_tile_position(geom, coords, position):
    """The kernel's word -> (token, channel) map is the inverse of the layout's position, for both orders."""
    seen = set()
    for word in range(geom.words):
        for e in range(2):
            for k in range(geom.regs_per_word):
                token, channel = coords(geom, word, e, k)
                assert position(geom, token, channel) == word * geom.codes_per_word + e * geom.regs_per_word + k
                seen.add((token, channel))
    assert len(seen) == TILE_TOKENS * geom.head_dim


def test_config_takes_the_bits_of_its_tensor():
    scheme = CASES[5][0]  # K4 channel-wise 128, V2 token-wise 64
    k, v = QuantizeConfig.of(scheme, "k"), QuantizeConfig.of(scheme, "v")
    assert (k.bits, v.bits) == (4, 2) and k.granule == v.granule == 128
    assert (k.geometry.words, v.geometry.words) == (64 * 128 * 4 // 32, 64 * 128 * 2 // 32)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg", COMPILED, ids=lambda c: f"{c.role}{c.bits}d{c.head_dim}{c.axis.value}{c.group}{c.layout}")
def test_quantize_compiles(cfg, arch):
    art = artifacts(compile_quantize(cfg, arch=arch))
    assert re.search(rf"^\.target {arch}$", art.ptx, re.M)
    # the documented rounding: IEEE division and round-half-even, never the approximate forms
    assert "div.rn.f32" in art.ptx and "cvt.rni.f32.f32" in art.ptx and "cvt.rn.f16.f32" in art.ptx
    assert not re.search(r"div\.(approx|full)", art.ptx)
    assert "st.global.b32" in art.ptx or "st.global.u32" in art.ptx  # whole packed words
    assert not re.search(r"ld\.local|st\.local", art.ptx) and art.resources().local_bytes == 0


def torch_quantize(src, cfg, codes, params, page, slot, fmt=None):
    """What the kernel must produce, by the CPU torch quantizer (the documented semantics; ``fmt``: the format,
    default the registered ``int<bits>``) and the layout's packer."""
    quant = TensorQuant(cfg.axis, cfg.group, fmt or cfg.bits)
    c, scale, offset = quantize_groups(src.cpu(), quant)
    n, kvh, t, d = src.shape
    words = PACKERS[cfg.layout][0](c.reshape(n, kvh, t // 64, 64, d), cfg.geometry)
    for i in range(n):
        if page[i] < 0:
            continue
        codes[page[i], :, slot[i] // 64:(slot[i] + t) // 64] = words[i]
        rows = slice(slot[i], slot[i] + t) if cfg.axis is Axis.TOKEN else slice(slot[i] // cfg.group, (slot[i] + t) // cfg.group)
        params[page[i], :, rows] = stack_params(scale[i], None if offset is None else offset[i], quant)


@pytest.mark.gpu
@pytest.mark.parametrize("runs", [1, 3])
@pytest.mark.parametrize("layout", ["hopper", "blackwell"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}-{c[1]}")
def test_quantize_tiles_bit_identical(case, layout, runs, rng, monkeypatch):
    """The append kernel writes either arch's bit order (it is SIMT: the Blackwell order is checked on
    any CUDA GPU); ``runs``: a source past the kernel's 32-bit index range launches per run of tiles (the limit
    lowered here to 4 tiles' elements)."""
    import foscar.kernels.quantize
    from foscar.kernels.quantize import quantize_tiles

    scheme, role = case
    cfg = QuantizeConfig.of(scheme, role, layout)
    kvh, num_pages, page_size, tiles = 3, 7, 256, 9
    if runs > 1:
        monkeypatch.setattr(foscar.kernels.quantize, "SRC_INDEX_LIMIT", 4 * kvh * cfg.granule * cfg.head_dim)
    launches, launch = [], foscar.kernels.quantize.launch

    def counted(compiled, *args):  # the tiles of each launch recorded
        launches.append(args[5])
        launch(compiled, *args)

    monkeypatch.setattr(foscar.kernels.quantize, "launch", counted)
    src = torch.randn(tiles, kvh, cfg.granule, cfg.head_dim, generator=rng) * 3 + torch.randn(cfg.head_dim, generator=rng) * 4
    src[0] = 0.5  # constant groups: scale 0, codes 0
    src[1] *= 1e-3  # tiny ranges
    src[2, :, :, :8] = 100.0  # outliers
    src = src.to(scheme.q_dtype)
    page = torch.randperm(num_pages, generator=rng)[:6].to(torch.int32)
    page = torch.cat([page, torch.full((tiles - 6,), -1, dtype=torch.int32)])  # three granules skipped
    slot = (torch.randint(0, page_size // cfg.granule, (tiles,), generator=rng) * cfg.granule).to(torch.int32)
    codes = torch.full((num_pages, kvh, page_size // 64, cfg.geometry.words), 0x5A5A5A5A, dtype=torch.int32)
    pshape = (num_pages, kvh, page_size, cfg.head_dim // cfg.group, 2) if cfg.axis is Axis.TOKEN else \
        (num_pages, kvh, page_size // cfg.group, cfg.head_dim, 2)
    params = torch.full(pshape, 7.0, dtype=torch.float16)  # sentinels: skipped granules must keep them
    want_codes, want_params = codes.clone(), params.clone()
    torch_quantize(src, cfg, want_codes, want_params, page.tolist(), slot.tolist())
    got_codes, got_params = codes.cuda(), params.cuda()
    quantize_tiles(src.cuda(), page.cuda(), slot.cuda(), got_codes, got_params, scheme, role, layout)
    torch.cuda.synchronize()
    assert launches == ([tiles] if runs == 1 else [4, 4, 1])  # tiles per launch
    assert torch.equal(got_params.cpu().view(torch.int16), want_params.view(torch.int16))
    assert torch.equal(got_codes.cpu(), want_codes)
