"""dequantize_pages against torch references that unpack through the explicit position formulas.

The references and the packer here use only the explicit formulas (``fragment.tile_position`` for the Hopper
bit order, ``blackwell.bw_tile_position`` for Blackwell's), not the kernel's ``TilePlan``, so the GPU tests check
the kernel's plan, paging and parameter indexing independently. On the CPU, the plan's tables are checked
against the same formulas (and the Hopper order against ``fragment.tile_layout``, built independently), and the
kernel's index arithmetic -- its own helpers, run on Python ints -- is replayed over every thread of a tile.
"""

import os
from collections import Counter

import pytest
import torch

from foscar.kernels.dequantize import POSITIONS, DequantizeConfig, tile_plan
from foscar.layouts import PACKERS, TileGeometry, evaluate_layout, tile_layout
from foscar.layouts.blackwell import bw_tile_position
from foscar.layouts.fragment import TILE_TOKENS, tile_position
from foscar.scheme import Axis

LAYOUTS = ("hopper", "blackwell")
EXPLICIT = {"hopper": tile_position, "blackwell": bw_tile_position}  # the formulas, not the kernel's tables
GEOMETRIES = [(role, bits, d) for role in ("k", "v") for bits in (2, 4, 8) for d in (64, 128, 256)]
CASES = [  # (bits, head_dim, role, axis, group)
    (2, 128, "k", "token", 128),
    (2, 128, "v", "token", 32),
    (4, 64, "k", "channel", 64),
    (2, 256, "k", "channel", 128),
    (4, 256, "v", "token", 64),
    (4, 128, "v", "channel", 32),
    (8, 128, "k", "channel", 128),
    (8, 64, "v", "token", 64),
    (4, 256, "k", "channel", 256),  # a group row per 4 tiles (a 256-token page)
]
CONFIGS = [DequantizeConfig(*case, layout=layout) for layout in LAYOUTS for case in CASES]


def cfg_id(cfg):
    return f"{cfg.layout}-{cfg.role}{cfg.bits}-d{cfg.head_dim}-{cfg.axis.value}{cfg.group}-{cfg.dtype}"


def _positions(cfg):
    """[64, D] code position of (token, channel) in a tile, by the layout's explicit formula."""
    g, position = cfg.geometry, EXPLICIT[cfg.layout]
    return torch.tensor([[position(g, t, c) for c in range(cfg.head_dim)] for t in range(TILE_TOKENS)])


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
    """Dense [batch, kv_heads, max_pages*page_size, D] in the config's dtype of a paged packed cache (any device):
    ``scale * code + offset`` exactly (float64 holds it), rounded once to FP32 -- one FMA -- then to the dtype."""
    num_pages, kv_heads, tiles_per_page, _ = codes.shape
    page_size = tiles_per_page * TILE_TOKENS
    c = unpack_tiles(codes.cpu(), cfg).reshape(num_pages, kv_heads, page_size, cfg.head_dim)
    p = params.cpu().double()
    p = p.repeat_interleave(cfg.group, dim=3 if cfg.axis is Axis.TOKEN else 2)
    x = (p[..., 0] * c.double() + p[..., 1]).float().to(getattr(torch, cfg.dtype))  # [num_pages, kv_heads, ps, D]
    batch, max_pages = page_table.shape
    x = x[page_table.cpu().long()]  # [batch, max_pages, kv_heads, page_size, D]
    return x.permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, max_pages * page_size, cfg.head_dim)


def random_cache(cfg, num_pages=5, kv_heads=3, page_size=128, batch=2, max_pages=3):
    """Random codes (all levels), params (never zero) and a page table that repeats and skips pages."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    codes = torch.randint(0, 2**cfg.bits, (num_pages, kv_heads, page_size // TILE_TOKENS, TILE_TOKENS, cfg.head_dim),
                          generator=gen)
    if cfg.axis is Axis.TOKEN:
        pshape = (num_pages, kv_heads, page_size, cfg.head_dim // cfg.group, 2)
    else:
        pshape = (num_pages, kv_heads, page_size // cfg.group, cfg.head_dim, 2)
    params = (torch.randn(pshape, generator=gen) * 0.5).half()
    params = torch.where(params == 0, torch.tensor(0.25, dtype=torch.half), params)
    page_table = torch.randint(0, num_pages, (batch, max_pages), generator=gen, dtype=torch.int32)
    return codes, pack_tiles(codes, cfg), params, page_table


def replay_plan(cfg, words):
    """The kernel's index arithmetic over one tile (its own helpers, on ints): the staging stores, then every
    thread's reads. Returns the codes [64, D] as the threads take them (-1: no thread made it) and the worst
    bank conflict (distinct words on one bank) of a warp's staging store or word read."""
    from foscar.kernels.dequantize import THREADS, Dequantize, _swizzled, _thread_part

    plan, kernel = cfg.plan, Dequantize(cfg)
    smem = [None] * cfg.tile_words
    worst = 1
    for st in range(kernel.stage_steps):
        for warp in range(THREADS // 32):  # a 128-byte phase of a warp's vector store: 32 // vec lanes
            phase = 32 // kernel.vec
            for first in range(0, 32, phase):
                banks = Counter()
                for lane in range(first, first + phase):
                    word = (st * THREADS + 32 * warp + lane) * kernel.vec
                    index = _swizzled(word, plan.swizzle)
                    for i in range(kernel.vec):
                        assert smem[index + i] is None, "two words staged at one index"
                        smem[index + i] = int(words[word + i])
                    banks[index % 32 // kernel.vec] += 1
                worst = max(worst, *banks.values())
    codes = torch.full((TILE_TOKENS, cfg.head_dim), -1, dtype=torch.int64)
    reads = {}  # (warp, step, word offset): the shared-memory indices of one warp-wide read
    for tid in range(THREADS):
        token0, channel0, bit0 = (_thread_part(plan.thread_strides(part), tid) for part in "tcp")
        word0, shift0 = _swizzled(bit0 >> 5, plan.swizzle), bit0 & 31
        for s in range(plan.steps):
            for k in range(plan.inner_tokens):
                for e in range(8):
                    token, bit = plan.element(s, k, e)
                    index = plan.word_index(word0, bit >> 5)
                    reads.setdefault((tid // 32, s, bit >> 5), set()).add(index)
                    word = (smem[index] & 0xFFFFFFFF) >> (shift0 if plan.dynamic_shift else 0)
                    assert codes[token0 + token, channel0 + e] == -1, "an element made twice"
                    codes[token0 + token, channel0 + e] = (word >> (bit & 31)) & ((1 << cfg.bits) - 1)
    for indices in reads.values():
        worst = max(worst, *Counter(i % 32 for i in indices).values())
    return codes, worst


# ---------------------------------------------------------------------------------------------- CPU


def test_config_of_a_scheme_takes_its_tensor_bits():
    from foscar import Scheme

    scheme = Scheme.make(k="channel", k_group=64, v="token", v_group=32, k_bits=4, v_bits=2)
    k, v = DequantizeConfig.of(scheme, "k"), DequantizeConfig.of(scheme, "v", layout="blackwell")
    assert (k.bits, k.axis, k.group) == (4, Axis.CHANNEL, 64) and (v.bits, v.axis, v.group) == (2, Axis.TOKEN, 32)
    assert (k.tile_words, v.tile_words) == (64 * 128 * 4 // 32, 64 * 128 * 2 // 32)
    assert (k.layout, v.layout) == ("hopper", "blackwell")


def test_the_kernel_reads_every_packed_order_the_packers_write():
    from foscar.kernels.quantize import WORD_CODE_COORDS

    assert set(POSITIONS) == set(PACKERS) == set(WORD_CODE_COORDS) == set(LAYOUTS)
    assert all(POSITIONS[layout] is EXPLICIT[layout] for layout in LAYOUTS)


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.bits == 2 or c.layout == "blackwell"], ids=cfg_id)
def test_pack_roundtrip(cfg):
    codes, words, _, _ = random_cache(cfg, num_pages=2, kv_heads=1, page_size=64)
    assert words.shape[-1] == cfg.tile_words
    assert torch.equal(unpack_tiles(words, cfg), codes)
    assert torch.equal(words, PACKERS[cfg.layout][0](codes, cfg.geometry))  # the package's packer agrees


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("role,bits,head_dim", GEOMETRIES)
def test_plan_tables_are_the_explicit_formulas(role, bits, head_dim, layout):
    """The plan's per-bit weights give every code's bit position as the layout's explicit formula does (and, for
    the Hopper order, as the independently built ``fragment.tile_layout``); every coordinate bit is split once
    among the inner, thread and step bits, channel bits 0-2 inner (a 16-byte store) and 3-5 on lanes (a warp
    writes whole 128-byte lines)."""
    geom = TileGeometry(role, bits, head_dim)
    plan = tile_plan(geom, layout)
    shape, stride = tile_layout(geom)
    for t in range(TILE_TOKENS):
        for c in range(head_dim):
            assert plan.position(t, c) == EXPLICIT[layout](geom, t, c) * bits, (t, c)
            if layout == "hopper":
                assert plan.position(t, c) == evaluate_layout(shape, stride, (t, c)) * bits, (t, c)
    every = sorted(plan.inner + plan.thread + plan.step)
    assert every == sorted([("t", i) for i in range(6)] + [("c", j) for j in range(head_dim.bit_length() - 1)])
    assert plan.inner[:3] == (("c", 0), ("c", 1), ("c", 2)) and plan.thread[:3] == (("c", 3), ("c", 4), ("c", 5))
    assert len(plan.thread) == 7 and all(b[0] == "t" for b in plan.inner[3:] + plan.step)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("role,bits,head_dim", GEOMETRIES)
def test_the_threads_take_every_code_once_without_bank_conflicts(role, bits, head_dim, layout, rng):
    """Replaying the kernel's index arithmetic over a random tile gives each (token, channel) its code by the
    explicit formula, made by exactly one thread; shared-memory stores and reads are conflict-free (the
    Blackwell INT8 K tile: 2-way reads, its lanes' words span 6 bank bits the swizzle cannot reach)."""
    cfg = DequantizeConfig(bits, head_dim, role, "token", 8, layout=layout)
    codes = torch.randint(0, 2**bits, (TILE_TOKENS, head_dim), generator=rng)
    taken, conflicts = replay_plan(cfg, pack_tiles(codes, cfg).tolist())
    assert torch.equal(taken, codes)
    assert conflicts == (2 if (layout, role, bits) == ("blackwell", "k", 8) else 1)
    assert cfg.plan.bank_conflicts() == conflicts


CPU_COMPILES = [DequantizeConfig(*case, layout=layout) for layout in LAYOUTS
                for case in [(2, 128, "k", "channel", 128), (2, 128, "v", "token", 128), (4, 128, "k", "token", 128),
                             (4, 64, "v", "channel", 64)]]


@pytest.mark.sass
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("cfg", CPU_COMPILES, ids=cfg_id)
def test_both_orders_compile_with_one_read_per_word_and_store_per_chunk(cfg, arch):
    """Each layout compiles for each arch (no GPU) into the planned instruction stream: 16-byte staging loads and
    stores, one LDS per word a thread reads, one STG.128 per 8-channel chunk, no local memory, and at most 8
    SASS instructions per output element, at most 7 at D=128 (10.6-15.0 before the plan, 5.3-6.6 with it;
    nvidia-cutlass-dsl 4.8.1)."""
    from foscar.inspect import artifacts
    from foscar.kernels import compile_dequantize
    from foscar.kernels.dequantize import THREADS, Dequantize

    art = artifacts(compile_dequantize(cfg, arch=arch))
    assert art.arch == arch
    plan, tiles = cfg.plan, Dequantize(cfg).tiles
    elements = TILE_TOKENS * cfg.head_dim // THREADS * tiles
    reads = tiles * sum(len({plan.element(s, k, e)[1] >> 5 for k in range(plan.inner_tokens) for e in range(8)})
                        for s in range(plan.steps))
    mix = art.mix(full_opcodes=True)
    assert mix["LDG.E.128"] >= tiles and mix["STS.128"] >= tiles
    assert sum(n for op, n in mix.items() if op.startswith("LDS")) == reads
    assert mix["STG.E.128"] == elements // 8
    assert mix["LDL"] == mix["STL"] == 0 and art.resources().local_bytes == 0
    assert sum(mix.values()) <= (7 if cfg.head_dim == 128 else 8) * elements, sum(mix.values()) / elements


def test_layout_is_validated_naming_the_argument():
    from foscar.kernels import dequantize_pages

    with pytest.raises(ValueError, match=r"layout must be one of \['blackwell', 'hopper'\], got 'ampere'"):
        DequantizeConfig(2, 128, "k", "token", 128, layout="ampere")
    z = torch.zeros(1)
    with pytest.raises(ValueError, match=r"layout must be one of \['blackwell', 'hopper'\] .*got 'ampere'"):
        dequantize_pages(z, z, z, DequantizeConfig(2, 128, "k", "token", 128), "k", layout="ampere")
    cfg = DequantizeConfig(2, 128, "k", "token", 128, layout="blackwell")
    with pytest.raises(ValueError, match="layout='hopper' contradicts the config's layout='blackwell'"):
        dequantize_pages(z, z, z, cfg, "k", layout="hopper")


def test_dequantize_pages_refuses_a_dtype_its_config_contradicts():
    from foscar.kernels import dequantize_pages

    cfg = DequantizeConfig(2, 128, "k", "token", 128, "float16")
    with pytest.raises(ValueError, match=r"dtype=torch.bfloat16 contradicts the config's dtype='float16'"):
        dequantize_pages(torch.zeros(1), torch.zeros(1), torch.zeros(1), cfg, "k", torch.bfloat16)
    with pytest.raises(ValueError, match="dtype must be torch.bfloat16 or torch.float16"):
        dequantize_pages(torch.zeros(1), torch.zeros(1), torch.zeros(1), cfg, "k", torch.float32)


def test_pages_dequantizer_names_a_tensor_of_the_wrong_rank():
    """``codes`` and ``page_table`` of the wrong rank are named, not unpacked into Python's own error."""
    from foscar.kernels import PagesDequantizer, dequantize_pages

    cfg = DequantizeConfig(2, 128, "k", "token", 128, "bfloat16")
    with pytest.raises(ValueError, match=r"codes: need a \[num_pages, kv_heads, tiles per page, \d+\] int32 tensor, "
                                         r"got \(3, 2, 2\)"):
        dequantize_pages(torch.zeros(3, 2, 2), torch.zeros(1), torch.zeros(1, 1), cfg, "k")
    dequantizer = object.__new__(PagesDequantizer)  # (a real one needs CUDA pools)
    with pytest.raises(ValueError, match=r"page_table: need a \[batch, max_pages\] int32 tensor, got \(3,\)"):
        dequantizer(torch.zeros(3, dtype=torch.int32))


def test_benchmark_checks_its_arguments_then_says_it_needs_a_gpu(monkeypatch, capsys):
    """``benchmarks.dequantize`` (the pattern of tests/test_benchmark_cli.py): a bad choice is named before the GPU
    check, and without a GPU it stops at once."""
    from benchmarks import dequantize

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a GPU machine
    with pytest.raises(SystemExit, match="benchmarks.dequantize needs a CUDA GPU"):
        dequantize.main([])
    for args, message in [(["--layouts", "ampere"], "--layouts must name some of"),
                          (["--methods", "int2-kc128+sw"], "--methods: 'int2-kc128+sw' is not"),
                          (["--tokens", "100"], "--tokens must be a positive multiple of 128")]:
        with pytest.raises(SystemExit):
            dequantize.main(args)
        assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[2]}{c[0]}-d{c[1]}-{c[3]}{c[4]}")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dequantize_pages_matches_reference(layout, case, dtype):
    """Every element of a NaN-poisoned output, exactly: random codes and params, a page table that repeats and
    skips pages, page sizes of one to four tiles."""
    from foscar.kernels import dequantize_pages

    cfg = DequantizeConfig(*case, dtype=dtype, layout=layout)
    for page_size in sorted({max(64, cfg.group if cfg.axis is Axis.CHANNEL else 64), 256}):
        _, words, params, page_table = random_cache(cfg, page_size=page_size)
        ref = dequantize_reference(words, params, page_table, cfg)
        out = torch.full(ref.shape, torch.nan, dtype=ref.dtype, device="cuda")
        got = dequantize_pages(words.cuda(), params.cuda(), page_table.cuda(), cfg, cfg.role, out=out)
        torch.cuda.synchronize()
        assert got is out and torch.equal(out.cpu(), ref), (page_size, (out.cpu() != ref).sum().item())


@pytest.mark.gpu
def test_replayed_launches_take_each_call_s_tables_lengths_and_stream():
    """``foscar.jit.launch`` replays a call's converted arguments when its pointers, numbers and stream recur: the
    same table tensor refilled, a shorter table (a new ``max_pages``), a side stream and the first call again each
    give their own reference exactly, and no kernel keeps more than ``BOUND_CALLS`` bound calls."""
    from foscar import jit
    from foscar.kernels.dequantize import PagesDequantizer

    cfg = DequantizeConfig(2, 128, "k", Axis.CHANNEL, 128, dtype="bfloat16")
    _, words, params, first = random_cache(cfg, num_pages=7, batch=2, max_pages=4)
    dequantizer = PagesDequantizer(words.cuda(), params.cuda(), cfg, "k")
    table = first.cuda()
    refilled = torch.randint(0, 7, first.shape, dtype=torch.int32)
    calls = [(first, table, None), (refilled, table, None), (refilled[:, :2], table[:, :2].clone(), None),
             (refilled, table, torch.cuda.Stream()), (first, table, None)]
    for step, (host, device_table, stream) in enumerate(calls):
        if not torch.equal(device_table.cpu(), host):
            device_table.copy_(host)  # the same address, new pages
        ref = dequantize_reference(words, params, host, cfg)
        out = torch.full(ref.shape, torch.nan, dtype=ref.dtype, device="cuda")
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())  # the table's copy and the poison first
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            dequantizer(device_table, out)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), ref), step
    bound = jit._bound[id(dequantizer._compiled)][1]
    assert 2 <= len(bound) <= jit.BOUND_CALLS


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k_axis,v_axis,k_bits,v_bits", [("channel", "token", 2, 2), ("token", "token", 2, 2),
                                                         ("channel", "token", 4, 2), ("token", "channel", 2, 4),
                                                         ("token", "channel", 8, 8)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dequantize_pages_matches_quantize_kv(layout, k_axis, v_axis, k_bits, v_bits, dtype, rng):
    """A cache written by quantize_kv in each order, against its torch dequantizer (in float64, rounded once to
    FP32 then to ``dtype``: the kernel's one FMA), every element of every valid token exactly; and within one
    ulp of the torch dequantizer in FP32 (which rounds the product, then the sum)."""
    from foscar import Scheme, quantize_kv
    from foscar.kernels import dequantize_pages

    scheme = Scheme.make(k=k_axis, k_group=64, v=v_axis, v_group=64, head_dim=128, k_bits=k_bits, v_bits=v_bits)
    k, v = (torch.randn(2, 2, 300, 128, generator=rng).bfloat16() for _ in range(2))
    lengths = torch.tensor([300, 200], dtype=torch.int32)
    cache = quantize_kv(k.cuda(), v.cuda(), scheme, page_size=128, lengths=lengths, layout=layout)
    exact, fp32 = cache.dequantize(torch.float64), cache.dequantize()
    for i, role in enumerate(("k", "v")):
        codes, params = (cache.k_codes, cache.k_params) if role == "k" else (cache.v_codes, cache.v_params)
        out = torch.full((2, 2, cache.max_tokens, 128), torch.nan, dtype=dtype, device="cuda")
        dequantize_pages(codes, params, cache.page_table, scheme, role, dtype, layout=layout, out=out)
        rtol = 2**-7 if dtype == torch.bfloat16 else 2**-10
        for b, length in enumerate(lengths.tolist()):
            assert torch.equal(out[b, :, :length], exact[i][b, :, :length].float().to(dtype)), (role, b)
            torch.testing.assert_close(out[b, :, :length].float(), fp32[i][b, :, :length], rtol=rtol, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_cached_blocks_of_a_gpu_cache_run_the_kernel_in_its_arch_order(arch, rng, monkeypatch):
    """PagedKVCache._cached_blocks (attend_chunk's prefix blocks) of a CUDA cache dequantizes with the kernel in
    the cache arch's bit order -- Blackwell's too, on any GPU: a use_kernels=False cache holds that order --
    and gives what the torch dequantizer gives (in float64, rounded like the kernel's FMA)."""
    import foscar.cache
    from foscar import Scheme
    from foscar.kernels.dequantize import PagesDequantizer
    from foscar.quantize import QuantizedKV

    calls = []

    class Counted(PagesDequantizer):
        def __call__(self, *args, **kwargs):
            calls.append(self.cfg.layout)
            return super().__call__(*args, **kwargs)

    monkeypatch.setattr(foscar.cache, "PagesDequantizer", Counted)
    monkeypatch.setattr(foscar.cache, "BLOCK_BYTES", 1)  # one page per block
    scheme = Scheme.make(2, "channel", 128, "token", 128, 128, 4)
    cache = foscar.cache.PagedKVCache(scheme, 1, 2, 24, 2, 4096, sink=64, window=256, device="cuda",
                                      use_kernels=False, arch=arch)
    layout = {"sm_90a": "hopper", "sm_100a": "blackwell"}[arch]
    assert cache.arch.layout == layout
    seq = cache.allocate()
    k = torch.randn(1, 2, 1000, 128, generator=rng).bfloat16()
    cache.append(0, [seq], k.cuda(), torch.randn_like(k).cuda())
    n, ps = cache.seq_len(seq), cache.page_size
    blocks = list(cache._cached_blocks(0, seq, n, torch.bfloat16))
    pages = -(-cache.quantized_tokens(n) // ps)
    assert pages >= 3 and calls == [layout] * 2 * pages
    for first, (kb, vb) in enumerate(blocks[:pages]):
        held = min(cache.quantized_tokens(n) - first * ps, ps)
        table = cache.page_table[seq:seq + 1, first:first + 1].clone()
        ref = QuantizedKV(scheme, ps, cache.k_codes[0], cache.k_params[0], cache.v_codes[0], cache.v_params[0], table,
                          torch.tensor([held], device="cuda"), cache.arch.layout).dequantize(torch.float64)
        for got, want in zip((kb, vb), ref):
            assert torch.equal(got, want[0, :, :held].float().bfloat16())


@pytest.mark.gpu
def test_an_output_past_32_bit_offsets_is_refused_before_it_is_allocated(monkeypatch):
    """The kernel's output offsets are 32-bit: 3 sequences x 131073 pages x 64 tokens x 128 channels (3.2e9
    elements) wrote the third sequence at a negative offset (a helper's audit, from the PTX)."""
    import foscar.kernels.dequantize as dq
    from foscar import Scheme, quantize_kv

    scheme = Scheme.make(4)
    k = torch.randn(1, 1, 64, 128, device="cuda").bfloat16()
    cache = quantize_kv(k, k.clone(), scheme, 64)
    monkeypatch.setattr(dq, "launch", lambda *a, **kw: pytest.fail("launched past the kernel's 32-bit offsets"))
    table = torch.zeros(3, 131073, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="page_table: 3 x 131073 pages dequantize to .* fewer than 2\\^31"):
        dq.dequantize_pages(cache.k_codes, cache.k_params, table, scheme, "k")
