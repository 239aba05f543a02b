"""dequantize_pages against a torch reference that unpacks through fragment.tile_position.

The reference and the packer here use only the explicit formula (not the CuTe layout the kernel
uses), so the GPU test checks the kernel's layout, paging and parameter indexing independently.
"""

import os

import pytest
import torch

from foscar.kernels.dequantize import DequantizeConfig
from foscar.layouts.fragment import TILE_TOKENS, tile_position
from foscar.scheme import Axis

CONFIGS = [
    DequantizeConfig(bits, d, role, axis, group)
    for bits, d, role, axis, group in [
        (2, 128, "k", "token", 128),
        (2, 128, "v", "token", 32),
        (4, 64, "k", "channel", 64),
        (2, 256, "k", "channel", 128),
        (4, 256, "v", "token", 64),
        (4, 128, "v", "channel", 32),
    ]
]


def _positions(cfg):
    """[64, D] code position of (token, channel) in a tile."""
    g = cfg.geometry
    return torch.tensor([[tile_position(g, t, c) for c in range(cfg.head_dim)] for t in range(TILE_TOKENS)])


def pack_tiles(codes, cfg):
    """int codes [..., 64, D] -> int32 words [..., tile_words], by the explicit formula."""
    pos = _positions(cfg).flatten()
    cpw = 32 // cfg.bits
    flat = torch.zeros(*codes.shape[:-2], cfg.tile_words * cpw, dtype=torch.int64)
    flat[..., pos] = codes.flatten(-2).to(torch.int64)
    shifts = torch.arange(cpw, dtype=torch.int64) * cfg.bits
    words = (flat.unflatten(-1, (cfg.tile_words, cpw)) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_tiles(words, cfg):
    """int32 words [..., tile_words] -> int codes [..., 64, D]."""
    pos = _positions(cfg)
    cpw = 32 // cfg.bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    return (w[..., pos // cpw] >> ((pos % cpw) * cfg.bits)) & ((1 << cfg.bits) - 1)


def dequantize_reference(codes, params, page_table, cfg):
    """Dense fp32 [batch, kv_heads, max_pages*page_size, D] of a paged packed cache (any device)."""
    num_pages, kv_heads, tiles_per_page, _ = codes.shape
    page_size = tiles_per_page * TILE_TOKENS
    c = unpack_tiles(codes.cpu(), cfg).reshape(num_pages, kv_heads, page_size, cfg.head_dim)
    p = params.cpu().float()
    if cfg.axis is Axis.TOKEN:
        p = p.repeat_interleave(cfg.group, dim=3)
    else:
        p = p.repeat_interleave(cfg.group, dim=2)
    x = p[..., 0] * c.float() + p[..., 1]  # [num_pages, kv_heads, page_size, D]
    batch, max_pages = page_table.shape
    x = x[page_table.cpu().long()]  # [batch, max_pages, kv_heads, page_size, D]
    return x.permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, max_pages * page_size, cfg.head_dim)


def random_cache(cfg, num_pages=5, kv_heads=3, page_size=128, batch=2, max_pages=3):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    codes = torch.randint(0, 2**cfg.bits, (num_pages, kv_heads, page_size // TILE_TOKENS, TILE_TOKENS, cfg.head_dim),
                          generator=gen)
    if cfg.axis is Axis.TOKEN:
        pshape = (num_pages, kv_heads, page_size, cfg.head_dim // cfg.group, 2)
    else:
        pshape = (num_pages, kv_heads, page_size // cfg.group, cfg.head_dim, 2)
    params = (torch.randn(pshape, generator=gen) * 0.5).half()
    page_table = torch.randint(0, num_pages, (batch, max_pages), generator=gen, dtype=torch.int32)
    return codes, pack_tiles(codes, cfg), params, page_table


def test_config_of_a_scheme_takes_its_tensor_bits():
    from foscar import Scheme

    scheme = Scheme.make(k="channel", k_group=64, v="token", v_group=32, k_bits=4, v_bits=2)
    k, v = DequantizeConfig.of(scheme, "k"), DequantizeConfig.of(scheme, "v")
    assert (k.bits, k.axis, k.group) == (4, Axis.CHANNEL, 64) and (v.bits, v.axis, v.group) == (2, Axis.TOKEN, 32)
    assert (k.tile_words, v.tile_words) == (64 * 128 * 4 // 32, 64 * 128 * 2 // 32)


@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=str)
def test_pack_roundtrip(cfg):
    codes, words, _, _ = random_cache(cfg, num_pages=2, kv_heads=1, page_size=64)
    assert words.shape[-1] == cfg.tile_words
    assert torch.equal(unpack_tiles(words, cfg), codes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_dequantize_pages_matches_reference(cfg):
    from foscar.kernels import dequantize_pages

    page_size = 256 if cfg.axis is Axis.CHANNEL and cfg.group > 64 else 128
    _, words, params, page_table = random_cache(cfg, page_size=page_size)
    ref = dequantize_reference(words, params, page_table, cfg)
    out = dequantize_pages(words.cuda(), params.cuda(), page_table.cuda(), cfg, cfg.role)
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    # the kernel rounds one fp32 FMA to bf16; the reference rounds a product and a sum
    torch.testing.assert_close(out.float().cpu(), ref.bfloat16().float(), rtol=2**-7, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k_axis,v_axis,k_bits,v_bits", [("channel", "token", 2, 2), ("token", "token", 2, 2),
                                                         ("channel", "token", 4, 2), ("token", "channel", 2, 4)])
def test_dequantize_pages_matches_quantize_kv(k_axis, v_axis, k_bits, v_bits, dtype, rng):
    from foscar import Scheme, quantize_kv
    from foscar.kernels import dequantize_pages

    scheme = Scheme.make(k=k_axis, k_group=64, v=v_axis, v_group=64, head_dim=128, k_bits=k_bits, v_bits=v_bits)
    gen = rng
    k, v = (torch.randn(2, 2, 300, 128, generator=gen).bfloat16() for _ in range(2))
    cache = quantize_kv(k.cuda(), v.cuda(), scheme, page_size=128, lengths=torch.tensor([300, 200], dtype=torch.int32))
    refs = cache.dequantize()
    for role, ref in zip(("k", "v"), refs):
        codes, params = (cache.k_codes, cache.k_params) if role == "k" else (cache.v_codes, cache.v_params)
        out = dequantize_pages(codes, params, cache.page_table, scheme, role, dtype)
        assert out.dtype == dtype
        rtol = 2**-7 if dtype == torch.bfloat16 else 2**-10  # one ulp: the kernel's s*c+z may be one FMA
        for b, length in enumerate(cache.lengths.tolist()):
            torch.testing.assert_close(out[b, :, :length].float(), ref[b, :, :length].float(), rtol=rtol, atol=1e-6)


def test_dequantize_pages_refuses_a_dtype_its_config_contradicts():
    from foscar.kernels import dequantize_pages

    cfg = DequantizeConfig(2, 128, "k", "token", 128, "float16")
    with pytest.raises(ValueError, match=r"dtype=torch.bfloat16 contradicts the config's dtype='float16'"):
        dequantize_pages(torch.zeros(1), torch.zeros(1), torch.zeros(1), cfg, "k", torch.bfloat16)
    with pytest.raises(ValueError, match="dtype must be torch.bfloat16 or torch.float16"):
        dequantize_pages(torch.zeros(1), torch.zeros(1), torch.zeros(1), cfg, "k", torch.float32)
