"""PagedKVCache logic on CPU tensors (torch quantizer path): page accounting, round trips through
the sink / quantized pages / recent ring, append paths, attention, rotation, and error paths that
must leave the cache unchanged."""

import math

import pytest
import torch

import foscar.cache
from foscar import Scheme
from foscar.cache import PagedKVCache, PagePoolFull, hadamard
from foscar.quantize import dequantize_groups, quantize_groups

SCHEMES = [
    Scheme.make(2, "channel", 128, "token", 64, 64, 2),  # KIVI-style: 128-token granule
    Scheme.make(4, "token", 64, "token", 64, 64, 2),  # OSCAR-style: 64-token granule
    Scheme.make(2, "channel", 64, "channel", 32, 64, 1),
    Scheme.make(None, "channel", 64, "token", 32, 64, 2, k_bits=4, v_bits=2),  # K and V of different widths
]


def make_cache(scheme=SCHEMES[0], layers=2, num_pages=24, max_seqs=4, sink=16, window=128, **kw):
    return PagedKVCache(scheme, layers, 2, num_pages, max_seqs, 1500, sink=sink, window=window, device="cpu", **kw)


def kv(rng, scheme, batch, tokens, heads=2):
    shape = (batch, heads, tokens, scheme.head_dim)
    k = torch.randn(shape, generator=rng) + 2 * torch.randn(scheme.head_dim, generator=rng)
    return k.to(scheme.q_dtype), torch.randn(shape, generator=rng).to(scheme.q_dtype)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_round_trip_and_append_paths(scheme, rng):
    """Token by token, in chunks and at once give the same cache; dense() is the sink and recent
    tokens exactly and the quantized span exactly as quantize_groups + dequantize_groups give it."""
    k, v = kv(rng, scheme, 2, 900)
    caches = [make_cache(scheme) for _ in range(3)]
    ids = [[c.allocate(), c.allocate()] for c in caches]
    caches[0].append(1, ids[0], k, v)
    for t in range(0, 900, 97):
        caches[1].append(1, ids[1], k[:, :, t:t + 97], v[:, :, t:t + 97])
    caches[2].append(1, ids[2], k[:, :, :600], v[:, :, :600])
    for t in range(600, 900):
        caches[2].append(1, ids[2], k[:, :, t:t + 1], v[:, :, t:t + 1])
    cache = caches[0]
    s, qn = cache.sink, cache.quantized_tokens(900)
    assert qn == cache.granule * ((900 - s - cache.window) // cache.granule) and qn % cache.granule == 0
    for b in range(2):
        dense = [c.dense(1, i[b]) for c, i in zip(caches, ids)]
        for other in dense[1:]:
            assert all(torch.equal(x, y) for x, y in zip(dense[0], other))
        for x, ref, quant in zip(dense[0], (k[b], v[b]), (scheme.k, scheme.v)):
            assert x.shape == (2, 900, scheme.head_dim)
            assert torch.equal(x[:, :s], ref[:, :s].float()) and torch.equal(x[:, s + qn:], ref[:, s + qn:].float())
            codes, scale, offset = quantize_groups(ref[:, s:s + qn], quant)
            assert torch.equal(x[:, s:s + qn], dequantize_groups(codes, scale, offset, quant))
    for c in caches:  # layer 0 untouched
        assert c.seq_len(ids[0][0], layer=0) == 0 and c.seq_len(ids[0][0], layer=1) == 900


def test_the_decode_plans_its_parts_from_the_mean_packed_tokens(rng):
    """What the cache tells the decode launch for planning past one wave (``foscar.work_list.wave_budget``): the
    mean packed tokens of the attended sequences (less ``later`` tokens each), from the host mirror."""
    scheme = SCHEMES[1]  # granule 64
    cache = make_cache(scheme, sink=16, window=128)
    ids = [cache.allocate() for _ in range(3)]
    for seq, n in zip(ids, (100, 16 + 128 + 64 * 3 + 5, 16 + 128 + 64 * 9)):
        cache.append(0, [seq], *kv(rng, scheme, 1, n))
    assert [cache.quantized_tokens(cache.seq_len(s)) for s in ids] == [0, 192, 576]
    assert cache._packed_mean(0, tuple(ids), 0) == (0 + 192 + 576) // 3
    assert cache._packed_mean(0, tuple(ids[1:]), 0) == (192 + 576) // 2
    assert cache._packed_mean(0, tuple(ids[2:]), 1) == 512  # a truncate of the last token: one granule less
    assert cache._packed_mean(1, tuple(ids), 0) == 0  # nothing in layer 1


def test_page_accounting(rng):
    scheme = SCHEMES[1]
    cache = make_cache(scheme, num_pages=10, sink=16, window=128)
    assert cache.granule == 64 and cache.page_size == 128 and cache.ring == 192
    a, b = cache.allocate(), cache.allocate(num_tokens=16 + 128 + 3 * 64)
    assert cache.pages_of(a) == [] and len(cache.pages_of(b)) == 2 and cache.free_pages == 8
    k, v = kv(rng, scheme, 1, 500)
    cache.append(0, [a], k, v)
    assert len(cache.pages_of(a)) == cache.pages_for(500) == math.ceil(cache.quantized_tokens(500) / 128)
    assert cache.free_pages == 10 - 2 - cache.pages_for(500)
    assert cache.page_table[a, :len(cache.pages_of(a))].tolist() == cache.pages_of(a)
    assert (cache.page_table[a, len(cache.pages_of(a)):] == cache.trash_page).all()
    cache.append(1, [a], k[:, :, :10], v[:, :, :10])  # another layer: pages are shared, none added
    assert cache.free_pages == 10 - 2 - cache.pages_for(500)
    pages_a = cache.pages_of(a)
    cache.free(a)
    assert cache.free_pages == 8 and cache.sequences == [b]
    assert (cache.page_table[a] == cache.trash_page).all() and (cache.lengths[:, a] == 0).all()
    c = cache.allocate()
    assert c == a  # slot reused, empty
    assert cache.seq_len(c) == 0 and cache.pages_of(c) == []
    cache.append(0, [c], k, v)
    assert sorted(cache.pages_of(c)) == sorted(pages_a)
    pages = len(cache.pages_of(b)) + len(cache.pages_of(c))
    assert cache.used_bytes() == pages * cache.bytes_per_page() + 2 * cache.k_bf16[:, 0].numel() * 2 * 2


def attention(q, k, v, sm_scale):
    """float64 attention of q [Hq, D] over k, v [kvh, n, D]."""
    kvh = k.shape[0]
    qg = q.double().reshape(kvh, -1, q.shape[-1])
    scores = torch.einsum("hrd,hld->hrl", qg, k.double()) * sm_scale
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("hrl,hld->hrd", torch.softmax(scores, -1), v.double())
    return out.reshape(q.shape), lse.reshape(-1)


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("scheme", SCHEMES[:2] + SCHEMES[3:], ids=lambda s: s.name)
def test_attend_matches_dense(scheme, rotate, rng):
    cache = make_cache(scheme, rotate=rotate)
    ids = [cache.allocate() for _ in range(3)]
    lengths = [5, 150, 700]  # only sink; sink + ring; all three parts
    for i, n in zip(ids, lengths):
        k, v = kv(rng, scheme, 1, n)
        cache.append(0, [i], k, v)
    order = [ids[2], ids[0], ids[1]]  # a non-contiguous batch
    q = torch.randn(3, 2 * scheme.gqa_ratio, scheme.head_dim, generator=rng).to(scheme.q_dtype)
    out, lse = cache.attend(0, order, q, sm_scale=0.1, return_lse=True)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    for b, seq in enumerate(order):
        k, v = cache.dense(0, seq)
        qb = (q[b].float() @ cache.rotation).to(q.dtype) if rotate else q[b]
        ref, ref_lse = attention(qb, k, v, 0.1)
        assert (out[b].double() - ref).abs().max() < 1e-2
        assert (lse[b].double() - ref_lse).abs().max() < 1e-4


def test_empty_sequence_attends_to_the_empty_softmax(rng):
    """An allocated sequence with no token yet: out 0 and lse -inf (never NaN), next to sequences with
    tokens, which are unaffected."""
    scheme = SCHEMES[0]
    cache = make_cache(scheme)
    empty, full, empty2 = cache.allocate(), cache.allocate(), cache.allocate()
    k, v = kv(rng, scheme, 1, 700)
    cache.append(0, [full], k, v)
    q = torch.randn(3, 2 * scheme.gqa_ratio, scheme.head_dim, generator=rng).to(scheme.q_dtype)
    out, lse = cache.attend(0, [empty, full, empty2], q, return_lse=True)
    for b in (0, 2):
        assert torch.equal(out[b], torch.zeros_like(out[b]))
        assert torch.equal(lse[b], torch.full_like(lse[b], -math.inf))
    kd, vd = cache.dense(0, full)
    ref, ref_lse = attention(q[1], kd, vd, scheme.head_dim**-0.5)
    assert (out[1].double() - ref).abs().max() < 1e-2
    assert (lse[1].double() - ref_lse).abs().max() < 1e-4


def expected_dense(cache, k, v):
    """What a sequence holding ``k, v [kv_heads, n, D]`` attends, from the inputs alone (not the cache):
    sink and recent tokens exact, the quantized span as quantize_groups + dequantize_groups give it."""
    s, qn = cache.sink, cache.quantized_tokens(k.shape[1])
    out = []
    for x, quant in ((k, cache.scheme.k), (v, cache.scheme.v)):
        codes, scale, offset = quantize_groups(x[:, s:s + qn], quant)
        quantized = dequantize_groups(codes, scale, offset, quant)
        out.append(torch.cat([x[:, :s].float(), quantized, x[:, s + qn:].float()], 1))
    return out


def check_attend(cache, ids, held, rng, layer=0):
    """``attend`` over ``ids`` equals float64 attention over what each sequence holds (``held[seq]``:
    its appended ``k, v [kv_heads, n, D]``), and ``dense`` (read from the packed pages) is that too."""
    scheme = cache.scheme
    q = torch.randn(len(ids), cache.kv_heads * scheme.gqa_ratio, scheme.head_dim, generator=rng).to(scheme.q_dtype)
    out, lse = cache.attend(layer, ids, q, sm_scale=0.1, return_lse=True)
    for b, seq in enumerate(ids):
        k, v = expected_dense(cache, *held[seq])
        assert all(torch.equal(x, y) for x, y in zip(cache.dense(layer, seq), (k, v)))
        ref, ref_lse = attention(q[b], k, v, 0.1)
        assert (out[b].double() - ref).abs().max() < 1e-2
        assert (lse[b].double() - ref_lse).abs().max() < 1e-4


@pytest.mark.parametrize("scheme", SCHEMES[:2], ids=lambda s: s.name)
def test_attend_after_one_token_appends_crossing_pages(scheme, rng):
    """One-token steps from the sink through several flushes and page boundaries attend what was
    appended: one sequence alone (its pages follow each other in the pool: attend reads them in place),
    then two growing together (interleaved pages: attend gathers them)."""
    cache = make_cache(scheme, max_seqs=3)
    k, v = kv(rng, scheme, 3, 600)

    def checked(n):  # lengths to check: around each flush, and some others
        return n % 97 == 0 or any(cache.quantized_tokens(n + d) != cache.quantized_tokens(n) for d in (-1, 1))

    alone = cache.allocate()
    held = {}
    for t in range(600):
        cache.append(0, [alone], k[:1, :, t:t + 1], v[:1, :, t:t + 1])
        held[alone] = (k[0, :, :t + 1], v[0, :, :t + 1])
        if checked(t + 1):
            check_attend(cache, [alone], held, rng)
    pages = cache.pages_of(alone)
    assert len(pages) == cache.pages_for(600) >= 3 and pages == list(range(pages[0], pages[0] + len(pages)))
    a, b = cache.allocate(), cache.allocate()
    cache.append(0, [a, b], k[1:, :, :200], v[1:, :, :200])
    for t in range(200, 500):
        cache.append(0, [a, b], k[1:, :, t:t + 1], v[1:, :, t:t + 1])
        held[a], held[b] = ((k[i, :, :t + 1], v[i, :, :t + 1]) for i in (1, 2))
        if checked(t + 1):
            check_attend(cache, [b, a], held, rng)
    assert cache.pages_of(a)[1] != cache.pages_of(a)[0] + 1  # interleaved with b's: gathered alone too
    check_attend(cache, [a], held, rng)
    check_attend(cache, [b, alone, a], held, rng)


@pytest.mark.parametrize("scheme", SCHEMES[:2], ids=lambda s: s.name)
def test_freed_pages_and_slots_reused_attend_only_what_was_written(scheme, rng):
    """A sequence that takes over a freed sequence's slot and pages attends its own tokens only, at every
    stage (nothing quantized yet, pages partly rewritten, more pages), alone (in place) and in a batch
    (gathered); the freed sequence's values, still in the pools past the new lengths, never show."""
    cache = make_cache(scheme, num_pages=8, max_seqs=2)
    k_old, v_old = kv(rng, scheme, 1, 1000)
    k_other, v_other = kv(rng, scheme, 1, 300)
    old, other = cache.allocate(), cache.allocate()
    cache.append(0, [old], k_old, v_old)
    cache.append(0, [other], k_other, v_other)
    pages_old = cache.pages_of(old)
    cache.free(old)
    new = cache.allocate()
    assert new == old
    k_new, v_new = kv(rng, scheme, 1, 800)
    k_new = -k_new  # unlike the old keys: attending one of those would show
    held = {other: (k_other[0], v_other[0])}
    n = 0
    for bulk_to, step_to in ((10, 20), (120, 150), (300, 330), (560, 600), (760, 800)):
        cache.append(0, [new], k_new[:, :, n:bulk_to], v_new[:, :, n:bulk_to])
        for t in range(bulk_to, step_to):
            cache.append(0, [new], k_new[:, :, t:t + 1], v_new[:, :, t:t + 1])
        n = step_to
        held[new] = (k_new[0, :, :n], v_new[0, :, :n])
        check_attend(cache, [new], held, rng)
        check_attend(cache, [other, new], held, rng)
    assert cache.pages_of(new) == pages_old[:cache.pages_for(800)]  # the freed pages, in their order


def test_pages_take_the_bit_order_of_the_cache_arch(rng):
    """One K4V2 sequence in a cache for each arch: pages packed in each arch's order (foscar.archs), the
    same tokens read back, and each tensor's pool as wide as its own bits."""
    from foscar.layouts import PACKERS, TileGeometry

    scheme = SCHEMES[3]
    k, v = kv(rng, scheme, 1, 700)
    caches = {arch: make_cache(scheme, arch=arch) for arch in ("sm_90a", "sm_100a")}
    assert make_cache(scheme).arch.name == "sm_90a"  # a CPU cache defaults to Hopper's order
    dense = {}
    for arch, cache in caches.items():
        seq = cache.allocate()
        cache.append(0, [seq], k, v)
        dense[arch] = cache.dense(0, seq)
        page = cache.pages_of(seq)[0]
        for role, codes, quant in (("k", cache.k_codes, scheme.k), ("v", cache.v_codes, scheme.v)):
            geom = TileGeometry(role, quant.bits, scheme.head_dim)
            assert codes.shape[-1] == geom.words == 64 * 64 * quant.bits // 32
            tiles = PACKERS[cache.arch.layout][1](codes[0, page], geom)  # the page's codes, by the arch's unpacker
            assert int(tiles.max()) <= 2**quant.bits - 1
        assert cache.arch.layout == {"sm_90a": "hopper", "sm_100a": "blackwell"}[arch]
    assert not torch.equal(caches["sm_90a"].k_codes, caches["sm_100a"].k_codes)  # different bit orders
    assert all(torch.equal(a, b) for a, b in zip(dense["sm_90a"], dense["sm_100a"]))  # the same values


def test_hadamard_and_rotation_helps_int2(rng):
    h = hadamard(64)
    assert torch.allclose(h @ h.T, torch.eye(64), atol=1e-6) and torch.equal(h, h.T)
    scheme = Scheme.make(2, "token", 64, "token", 64, 64, 1)
    k, v = kv(rng, scheme, 1, 900)
    k[..., 3] *= 20  # an outlier channel, as real keys have
    queries = torch.randn(256, 64, generator=rng)
    exact = queries @ k[0].float().transpose(-1, -2)  # [kvh, 256, tokens]
    errors = []
    for rotate in (False, True):
        cache = make_cache(scheme, layers=1, rotate=rotate, sink=0, window=64)
        seq = cache.allocate()
        cache.append(0, [seq], k, v)
        kd, _ = cache.dense(0, seq)  # dequantized, in the rotated basis when rotating
        qr = queries @ cache.rotation if rotate else queries
        errors.append(float((qr @ kd.transpose(-1, -2) - exact).pow(2).mean().sqrt()))  # RMS score error
    assert errors[1] < 0.9 * errors[0]


def snapshot(cache):
    tensors = {n: getattr(cache, n).clone() for n in ("k_codes", "k_params", "v_codes", "v_params", "k_bf16", "v_bf16",
                                                       "lengths", "page_table", "_written")}
    for copies in ("_dequantized", "_slots_fp32"):  # the torch path's fp32 copies
        for role, t in (getattr(cache, copies) or {}).items():
            tensors[f"{copies}[{role}]"] = t.clone()
    host = (list(cache._free_pages), [None if p is None else list(p) for p in cache._pages], cache._host_len.clone())
    return tensors, host


def assert_unchanged(cache, snap):
    tensors, host = snapshot(cache)
    for name, t in snap[0].items():
        assert torch.equal(tensors[name], t), name
    assert host[0] == snap[1][0] and host[1] == snap[1][1] and torch.equal(host[2], snap[1][2])


@pytest.mark.parametrize("held", [127, 100], ids=["one-token", "multi-token"])
def test_a_quantizer_refusal_leaves_the_cache_unchanged(held, rng, monkeypatch):
    """The torch path quantizes a granule in the append that completes it, after that append's checks: a refusal
    there (a format may refuse what the up-front checks pass; here v's, after k's quantizer ran) leaves the cache as
    it was: the lengths, and so every attend, the host and device lengths in step, k's codes, params and fp32 copy,
    and the page the append reserved for the granule (given back)."""
    scheme = SCHEMES[1]  # a 64-token granule: the 128th token completes the first past the window
    caches = [make_cache(scheme, layers=1, sink=0, window=64) for _ in range(2)]
    k, v = kv(rng, scheme, 1, 128)
    q = torch.randn(1, 4, scheme.head_dim, generator=rng).to(scheme.q_dtype)
    for cache in caches:
        cache.allocate()
        cache.append(0, [0], k[:, :, :held], v[:, :, :held])
    refused = caches[0]
    before, snap = refused.attend(0, [0], q), snapshot(refused)
    assert refused.pages_of(0) == []  # the refused append is the one that needs a page

    def refuse_v(src, quant, name):
        if name == "v":
            raise ValueError("refused by the format")
        return quantize_groups(src, quant, name=name)

    monkeypatch.setattr(foscar.cache, "quantize_groups", refuse_v)
    with pytest.raises(ValueError, match="refused by the format"):
        refused.append(0, [0], k[:, :, held:], v[:, :, held:])
    monkeypatch.undo()
    assert_unchanged(refused, snap)
    assert refused.seq_len(0) == held and torch.equal(refused.attend(0, [0], q), before)
    for cache in caches:
        cache.append(0, [0], k[:, :, held:], v[:, :, held:])
    assert int(refused.lengths[0, 0]) == refused.seq_len(0) == 128 and len(refused.pages_of(0)) == 1
    assert torch.equal(refused.attend(0, [0], q), caches[1].attend(0, [0], q))


def test_errors_name_the_argument_and_leave_the_cache_unchanged(rng):
    scheme = SCHEMES[1]
    cache = make_cache(scheme, num_pages=4, max_seqs=2)
    a, b = cache.allocate(), cache.allocate()
    k, v = kv(rng, scheme, 2, 400)
    cache.append(0, [a, b], k, v)
    snap = snapshot(cache)
    big_k, big_v = kv(rng, scheme, 2, 300)
    bad = [
        (PagePoolFull, "page pool full", lambda: cache.append(0, [a, b], big_k, big_v)),
        (PagePoolFull, "sequence slots", lambda: cache.allocate()),
        (PagePoolFull, "num_pages", lambda: cache.reserve(a, 1400)),
        (ValueError, "seq_ids: unknown sequence id 3", lambda: cache.append(0, [a, 3], k[:, :, :1], v[:, :, :1])),
        (ValueError, "seq_id: unknown sequence id 7", lambda: cache.free(7)),
        (TypeError, "seq_ids must be a list", lambda: cache.append(0, torch.tensor([a]), k[:1], v[:1])),
        (ValueError, "must not repeat", lambda: cache.append(0, [a, a], k, v)),
        (TypeError, "seq_ids must be an int sequence id, got bool", lambda: cache.append(0, [True], k[:1], v[:1])),
        # a non-finite value, refused by the torch path before anything changes (its quantizer would refuse it only
        # once its granule is due, appends later)
        (ValueError, "k holds inf or nan", lambda: cache.append(0, [a, b], k[:, :, :1].clone().fill_(math.nan),
                                                                v[:, :, :1])),
        (ValueError, "v holds inf or nan", lambda: cache.append(0, [a, b], k[:, :, :90], v[:, :, :90] * math.inf)),
        # finite in bf16, beyond the fp16 group params: the quantizer would refuse it appends later, after the slot
        # and the device length had moved
        (ValueError, r"k holds values beyond the float16 range \(\|x\| > 65504\)",
         lambda: cache.append(0, [a, b], k[:, :, :1] - 1e5, v[:, :, :1])),
        (ValueError, "v holds values beyond the float16 range",
         lambda: cache.append(0, [a, b], k[:, :, :1], v[:, :, :1].clone().index_fill_(-1, torch.tensor([3]), 7e4))),
        (TypeError, "k must have dtype torch.bfloat16", lambda: cache.append(0, [a, b], k.half(), v)),
        (TypeError, "v must have dtype", lambda: cache.append(0, [a, b], k, v.float())),
        (ValueError, "k has 4 heads; the cache holds kv_heads = 2", lambda: cache.append(0, [a, b], k.repeat(1, 2, 1, 1), v)),
        (ValueError, "v must have the shape of k", lambda: cache.append(0, [a, b], k, v[:, :, :5])),
        (ValueError, "k must have shape", lambda: cache.append(0, [a], k, v)),
        (ValueError, "layer must be", lambda: cache.append(2, [a, b], k, v)),
        (ValueError, "max_seq_len", lambda: cache.append(0, [a, b], *kv(rng, scheme, 2, 1200))),
        (ValueError, "q has 3 heads", lambda: cache.attend(0, [a, b], torch.zeros(2, 3, 64, dtype=torch.bfloat16))),
        (TypeError, "q must have dtype", lambda: cache.attend(0, [a, b], torch.zeros(2, 4, 64))),
        (ValueError, "sm_scale", lambda: cache.attend(0, [a, b], torch.zeros(2, 4, 64, dtype=torch.bfloat16), sm_scale=-1.0)),
    ]
    for error, message, call in bad:
        with pytest.raises(error, match=message):
            call()
        assert_unchanged(cache, snap)
    for name, kwargs in [("window", dict(window=100)), ("page_size", dict(page_size=96)), ("sink", dict(sink=-1)),
                         ("arch", dict(arch="sm_80"))]:
        with pytest.raises(ValueError, match=name):
            make_cache(scheme, **kwargs)
    for error, message, kwargs in [(TypeError, "rotate must be a bool, got 'yes'", dict(rotate="yes")),
                                   (TypeError, "use_kernels must be a bool or None, got 'no'", dict(use_kernels="no"))]:
        with pytest.raises(error, match=message):
            make_cache(scheme, **kwargs)
    with pytest.raises(ValueError, match="device must name a torch device"):
        PagedKVCache(scheme, 1, 2, 4, 2, 1500, device="tpu")


def test_allocate_prefilled_equals_appending(rng):
    """A sequence claimed with allocate_prefilled over pools that hold what appending wrote is the
    appended sequence: same pages, lengths, dense contents and attention, before and after one more token."""
    scheme = SCHEMES[1]
    appended, prefilled = make_cache(scheme), make_cache(scheme)
    k, v = kv(rng, scheme, 2, 700)
    ids = [appended.allocate(), appended.allocate()]
    for layer in range(2):
        appended.append(layer, ids, k, v)
    for name in ("k_codes", "k_params", "v_codes", "v_params", "k_bf16", "v_bf16"):
        getattr(prefilled, name).copy_(getattr(appended, name))
    assert [prefilled.allocate_prefilled(700), prefilled.allocate_prefilled(700)] == ids
    assert torch.equal(prefilled.page_table, appended.page_table) and torch.equal(prefilled.lengths, appended.lengths)
    assert prefilled.free_pages == appended.free_pages
    q = torch.randn(2, 4, scheme.head_dim, generator=rng).to(scheme.q_dtype)
    k1, v1 = kv(rng, scheme, 2, 1)
    for step in range(2):
        for layer in range(2):
            assert prefilled.seq_len(ids[1], layer) == 700 + step
            for a, b in zip(prefilled.dense(layer, ids[1]), appended.dense(layer, ids[1])):
                assert torch.equal(a, b)
            assert torch.equal(prefilled.attend(layer, ids, q), appended.attend(layer, ids, q))
            for cache in (prefilled, appended):
                cache.append(layer, ids, k1, v1)
    big = prefilled.allocate_prefilled(1500)  # 11 of the 16 free pages
    assert prefilled.seq_len(big, 1) == 1500 and len(prefilled.pages_of(big)) == prefilled.pages_for(1500)
    before = prefilled.lengths.clone()
    with pytest.raises(PagePoolFull):
        prefilled.allocate_prefilled(1500)
    assert prefilled.sequences == ids + [big] and torch.equal(prefilled.lengths, before)


def test_cpu_attend_work_follows_the_lengths_not_max_seq_len(rng, monkeypatch):
    """The torch path attends only the pages that hold tokens: a cache sized for 32K tokens attends a
    short sequence over its own pages, with the same result as a small cache."""
    widths = []
    real = PagedKVCache._attend_plan

    def spy(self, *args):
        plan = real(self, *args)
        widths.append(plan.width // self.page_size)  # the pages attended
        return plan

    monkeypatch.setattr(PagedKVCache, "_attend_plan", spy)
    scheme = SCHEMES[1]
    k, v = kv(rng, scheme, 1, 700)
    q = torch.randn(1, 2 * scheme.gqa_ratio, scheme.head_dim, generator=rng).to(scheme.q_dtype)
    outs = []
    for max_seq_len in (1500, 32768):
        cache = PagedKVCache(scheme, 1, 2, 300, 1, max_seq_len, sink=16, window=128, device="cpu")
        seq = cache.allocate()
        cache.append(0, [seq], k, v)
        outs.append(cache.attend(0, [seq], q, return_lse=True))
    used = -(-cache.quantized_tokens(700) // cache.page_size)
    assert cache.max_pages > 50 * used and widths == [used, used]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_default_device_is_where_torch_can_run():
    cache = PagedKVCache(SCHEMES[1], 1, 2, 4, 1, 1024)
    assert cache.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda': torch sees no CUDA GPU"):
            PagedKVCache(SCHEMES[1], 1, 2, 4, 1, 1024, device="cuda")


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_planned_bytes_are_what_the_constructor_allocates(scheme):
    """The size check before allocating reads the same sizes the constructor then allocates."""
    cache = PagedKVCache(scheme, 3, 2, 5, 3, 3000, sink=16, window=256, device="cpu")
    planned, held = cache._planned_bytes(), cache.nbytes()
    assert list(planned.values())[:3] == [held["quantized"], held["bf16"], held["page_table"]]
    assert planned["lengths and counters (max_seqs)"] == (cache.lengths.untyped_storage().nbytes()
                                                          + cache._counters.untyped_storage().nbytes())


def test_absurd_sizes_are_refused_before_allocating(monkeypatch):
    """Sizes past the kernels' 32-bit indices, or past the device's memory, fail naming the argument."""
    import foscar.cache

    scheme = SCHEMES[1]
    with pytest.raises(ValueError, match=r"max_seq_len=1000000000000: .*32-bit ints.* at most 2147483647"):
        PagedKVCache(scheme, 1, 2, 4, 1, 10**12, device="cpu")
    with pytest.raises(ValueError, match=r"num_pages=2147483647: .*32-bit page indices.* at most 2147483646"):
        PagedKVCache(scheme, 1, 2, 2**31 - 1, 1, 4096, device="meta")
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: pytest.fail("allocated before refusing"))
    monkeypatch.setattr(torch, "full", lambda *a, **k: pytest.fail("allocated before refusing"))
    monkeypatch.setattr(foscar.cache, "_device_memory", lambda device: 2**31)
    # 8 layers x 8 KV heads x 4096 pages x 9 KiB (128 INT4 tokens of head_dim 64: 8 KiB of codes, 1 KiB of params)
    with pytest.raises(ValueError, match=r"need 2\.26 GiB \(the page pool \(num_pages\) 2\.25 GiB, the 16-bit sink "
                                         r"\+ window \(max_seqs, sink, window\) 0\.00586 GiB, .*\), more than the 2 GiB "
                                         r"of cpu; lower the arguments of the largest part"):
        PagedKVCache(scheme, 8, 8, 4095, 1, 4096, device="cpu")
    # 1000 sequences x 16777213 page-table columns x 4 bytes
    with pytest.raises(ValueError, match=r"\(the page table \(max_seqs x max_seq_len\) 62\.5 GiB, "):
        PagedKVCache(scheme, 1, 2, 4, 1000, 2**31 - 1, device="cpu")


def test_batch_indexes_stay_bounded_but_captured_ones_stay(rng, monkeypatch):
    """A serving loop meets a new batch of seq_ids almost every step: past INDEX_CACHE entries the oldest device
    indexes go, except those a captured CUDA graph reads (marked when used inside a capture)."""
    import foscar.cache

    monkeypatch.setattr(foscar.cache, "INDEX_CACHE", 8)
    cache = make_cache(SCHEMES[1], max_seqs=4)
    ids = [cache.allocate() for _ in range(4)]
    cache.append(0, ids, *kv(rng, SCHEMES[1], 4, 5))
    q = torch.randn(1, 2 * SCHEMES[1].gqa_ratio, SCHEMES[1].head_dim, generator=rng).to(SCHEMES[1].q_dtype)
    cache.attend(0, [ids[0]], q)
    monkeypatch.setattr(foscar.cache, "_capturing", lambda device: True)
    cache._rows([ids[0]])  # as inside a capture: pinned
    monkeypatch.setattr(foscar.cache, "_capturing", lambda device: False)
    batches = [(a, b) for a in ids for b in ids if a != b]
    for batch in batches:
        cache.attend(0, list(batch), q.expand(2, -1, -1).contiguous())
        assert len(cache._index_cache) <= 8
    assert (ids[0],) in cache._index_cache and batches[-1] in cache._index_cache
    assert batches[0] not in cache._index_cache


def test_the_host_lengths_follow_graph_replays_after_every_read(rng, monkeypatch):
    """Replays of a captured one-token append move the device ``lengths`` behind the host's back, at any time: every
    host read after a capture re-reads them, not only the first (which once cleared the flag, so that a second round
    of replays left ``seq_len`` short, ``truncate(1)`` removed 6 tokens and a chunk overwrote the replayed ones). The
    capture and its replays are simulated on the CPU: the append inside the capture, then the device work a replay
    re-executes (``_append_step``). And the torch path refuses to be captured (its quantizer checks values on the
    host), leaving the cache as it was."""
    import foscar.cache

    scheme = SCHEMES[1]
    cache = make_cache(scheme, layers=1)
    seq = cache.allocate()
    cache.append(0, [seq], *kv(rng, scheme, 1, 300))
    cache.reserve(seq, 1000)
    k, v = kv(rng, scheme, 1, 1)
    monkeypatch.setattr(foscar.cache, "_capturing", lambda device: True)
    with pytest.raises(RuntimeError, match="torch path"):
        cache.append(0, [seq], k, v)
    _, index = cache._rows([seq])
    monkeypatch.setattr(foscar.cache, "_capturing", lambda device: False)
    assert cache.seq_len(seq) == int(cache.lengths[0, seq]) == 300
    # the kernel path's captured append: the host marks the mirror, the graph holds the step (run once here)
    cache._appends_captured = True
    cache._append_step(0, index, cache._rotate(k), v, True)

    def replay(times):
        for _ in range(times):
            cache._append_step(0, index, cache._rotate(k), v, True)

    replay(3)
    assert cache.seq_len(seq) == int(cache.lengths[0, seq]) == 304
    replay(5)
    assert cache.seq_len(seq) == int(cache.lengths[0, seq]) == 309
    assert cache.seq_lens([seq]).tolist() == [[309]]
    cache.truncate(0, [seq], 1)
    assert int(cache.lengths[0, seq]) == 308
    replay(2)
    cache.append(0, [seq], *kv(rng, scheme, 1, 4))  # a chunk after more replays: appended after them
    assert cache.seq_len(seq) == int(cache.lengths[0, seq]) == 314


def test_replays_past_the_reserved_pages_are_refused_at_the_next_host_read(rng):
    """A captured append replayed past the pages ``reserve`` made quantizes its granules into the trash page: the
    tokens are lost. The next host read says so, naming the sequence, rather than attend without them; ``free`` still
    gives the sequence up, and the pool gets every page back. A replay after ``free`` is reported once. (Capture and
    replays simulated as above.)"""
    scheme = SCHEMES[1]
    cache = make_cache(scheme, layers=1)
    seq, other = cache.allocate(), cache.allocate()
    cache.append(0, [seq], *kv(rng, scheme, 1, 300))
    cache.reserve(seq, 320)
    pages, free = cache.pages_of(seq), cache.free_pages
    _, index = cache._rows([seq])
    k, v = kv(rng, scheme, 1, 1)
    cache._appends_captured = True
    while cache.pages_for(int(cache.lengths[0, seq]) + 1) <= len(pages):  # replays within the reserved pages
        cache._append_step(0, index, cache._rotate(k), v, True)
    assert cache.seq_len(seq) == int(cache.lengths[0, seq]) > 320
    assert cache.seq_len(other) == 0
    cache._append_step(0, index, cache._rotate(k), v, True)  # its granule has no page
    with pytest.raises(RuntimeError, match=f"sequence {seq}: graph replays appended up to .* trash page"):
        cache.seq_len(other)
    with pytest.raises(RuntimeError, match=f"sequence {seq}"):
        cache.append(0, [other], *kv(rng, scheme, 1, 3))
    assert cache.free_pages == free  # the refused append reserved nothing
    cache.free(seq)
    assert cache.free_pages == free + len(pages) and cache.seq_len(other) == 0
    cache._append_step(0, index, cache._rotate(k), v, True)  # a replay after free
    with pytest.raises(RuntimeError, match=f"appended to sequence {seq} after free"):
        cache.seq_len(other)
    assert cache.seq_len(other) == 0 and cache.allocate() == seq and cache.seq_len(seq) == 0  # reported once


def test_a_rotated_cache_refuses_what_its_rotation_takes_beyond_float16(rng):
    """``rotate=True`` quantizes the Hadamard-rotated k, up to sqrt(head_dim) times larger than k: a k inside
    float16's range may leave it once rotated (-10000 in every channel: 80000 in the first at head_dim 64). The torch
    path refuses it at the append, before anything changes; it once took it into the 16-bit slots, and its quantizer
    refused the granule appends later, every append after, with the sequence stuck."""
    scheme = SCHEMES[1]
    cache = make_cache(scheme, rotate=True)
    seq = cache.allocate()
    cache.append(0, [seq], *kv(rng, scheme, 1, 10))
    snap = snapshot(cache)
    k = torch.full((1, 2, 1, scheme.head_dim), -10000.0).to(scheme.q_dtype)
    with pytest.raises(ValueError, match=r"k holds values that the cache's rotation .* takes beyond the float16"):
        cache.append(0, [seq], k, torch.zeros_like(k))
    assert_unchanged(cache, snap)
    cache.append(0, [seq], k / 10, torch.zeros_like(k))  # 8000 once rotated: taken


def test_append_keeps_values_not_autograd_history(rng):
    """K/V that require grad (a forward outside no_grad) are appended as values: no cache tensor takes a grad_fn (its
    history would grow with every step), and what the cache holds equals the same append of detached K/V."""
    held, plain = make_cache(), make_cache()
    for cache in (held, plain):
        cache.allocate()
    for tokens in (300, 1, 1):
        k, v = kv(rng, held.scheme, 1, tokens)
        held.append(0, [0], k.requires_grad_(), v.requires_grad_())
        plain.append(0, [0], k.detach(), v.detach())
    tensors = {name: x for name, x in vars(held).items() if isinstance(x, torch.Tensor)}
    for name in ("_dequantized", "_slots_fp32"):  # the torch path's fp32 copies
        tensors.update({f"{name}.{role}": x for role, x in vars(held)[name].items()})
    assert tensors and not [name for name, x in tensors.items() if x.requires_grad or x.grad_fn is not None]
    for x, y in zip(held.dense(0, 0), plain.dense(0, 0)):
        assert torch.equal(x, y)
