"""PagedKVCache with several new tokens per sequence: ``attend_chunk`` (L query tokens over the cached tokens and,
causally, their own 16-bit K/V) against float64 attention, on the CPU torch path and (GPU tests) on the kernel
path's cache; ``truncate`` / ``rollback_limit`` (a rollback equals never having appended the tokens), and the
errors of both, which leave the cache unchanged."""

import copy

import pytest
import torch

import foscar.cache
import foscar.chunk_attention
from foscar import Scheme
from foscar.testing import causal_attention, causal_references
from test_cache import SCHEMES, assert_unchanged, expected_dense, kv, make_cache, snapshot

CHUNKS = [1, 2, 4, 8, 16, 3, 61, 100, 300, 1, 16, 130]  # appended in turn: lengths cross pages, granules, the window


FLOOR = 1e-5  # test_cache_decode_gpu's: a few BF16 ulps of outputs that are nearly exact in BF16


def assert_within_the_rule(out, lse, q, k, v, sm_scale, where, rounded_partials=False):
    """``out [L, Hq, D], lse [L, Hq]`` of the last ``L`` tokens of ``k, v [kvh, n, D]`` (causal) against float64:
    the project's rule, an error at most twice that of the same attention in q's dtype, plus FLOOR (the lse: at
    most that, or 1e-3).

    ``rounded_partials``: ``out`` merges partial attentions that were rounded to q's dtype (foscar.chunk_attention's
    blocks and pieces, as the fused attention returns them), which adds at most one rounding of each partial:
    ``u * sum_i w_i |o_i| <= u * (P @ |V|)`` per element (``u`` q's unit roundoff, ``w_i`` the partials' weights),
    allowed on top of the rule."""
    ref, ref_lse, low, low_lse = causal_references(q, k, v, sm_scale)
    rule = 2 * float((low.double() - ref).abs().max()) + FLOOR
    tol = torch.full_like(ref, rule)
    if rounded_partials:
        tol += torch.finfo(q.dtype).eps / 2 * causal_attention(q, k, v.abs(), sm_scale, torch.float64)[0]
    err = (out.cpu().double() - ref).abs()
    worst = int((err - tol).argmax())
    assert bool((err <= tol).all()), (where, float(err.flatten()[worst]), float(tol.flatten()[worst]))  # NaN fails
    lse_err = float((lse.cpu().double() - ref_lse).abs().max())
    lse_tol = max(2 * float((low_lse - ref_lse).abs().max()), rule, 1e-3)
    assert lse_err <= lse_tol, (where, lse_err, lse_tol)


def rotated(cache, x):
    """What the cache attends for 16-bit ``x`` (K or Q of a whole call): rotated and rounded as it stores keys, on
    the cache's device and with the call's batch shape (a GPU matmul rounds by shape: a key rotated alone can
    differ by 1 bit from the same key rotated in its batch)."""
    if cache.rotation is None:
        return x
    return (x.to(cache.device).float() @ cache.rotation).to(x.dtype).to(x.device)


def check_chunk(cache, ids, cached, rng, tokens, layer=0, sm_scale=0.1, transposed_q=False):
    """``attend_chunk`` of ``tokens`` fresh random tokens on ``ids`` equals float64 attention over what each
    sequence holds (``cached(seq)``: fp32 ``(k, v) [kvh, n, D]``) and the new tokens within the project's rule
    (``assert_within_the_rule``); the cache is unchanged. Returns the new tokens' ``(k, v)``. ``transposed_q``: q,
    k and v are transposed views of ``[batch, tokens, heads, D]`` tensors, as transformers' attention passes them."""
    scheme, dev = cache.scheme, cache.device
    heads = cache.kv_heads * scheme.gqa_ratio
    q = torch.randn(len(ids), tokens, heads, scheme.head_dim, generator=rng)
    if transposed_q:
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    q = q.to(scheme.q_dtype)
    k_new, v_new = kv(rng, scheme, len(ids), tokens, heads=cache.kv_heads)
    before = snapshot(cache)
    q_dev, k_dev, v_dev = (x.to(dev) for x in (q, k_new, v_new))
    if transposed_q:
        k_dev, v_dev = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k_dev, v_dev))
    assert q_dev.is_contiguous() != transposed_q
    out, lse = cache.attend_chunk(layer, ids, q_dev, k_dev, v_dev, sm_scale=sm_scale, return_lse=True)
    assert_unchanged(cache, before)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    q_seen, k_seen = rotated(cache, q), rotated(cache, k_new)
    for b, seq in enumerate(ids):
        k, v = cached(seq)
        k_all, v_all = (torch.cat([x.cpu(), y.float()], 1) for x, y in zip((k, v), (k_seen[b], v_new[b])))
        assert_within_the_rule(out[b], lse[b], q_seen[b], k_all, v_all, sm_scale, (seq, tokens),
                               rounded_partials=cache._dequantized is None)  # a kernel cache: foscar.chunk_attention
    return k_new, v_new


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_attend_chunk_matches_float64_causal_attention(scheme, rotate, rng):
    """Chunks of 1 .. 300 tokens on three sequences of different lengths (a non-contiguous batch, one of them
    empty at first), each chunk then appended, so the cached lengths cross the sink, the window, granules and
    pages; the reference reads what each sequence should hold from the appended inputs alone."""
    cache = make_cache(scheme, rotate=rotate, num_pages=40)
    ids = [cache.allocate() for _ in range(3)]
    held = {seq: [] for seq in ids}
    k0, v0 = kv(rng, scheme, 1, 150)
    cache.append(0, [ids[1]], k0, v0)
    held[ids[1]].append((k0[0], v0[0]))
    k0, v0 = kv(rng, scheme, 1, 17)
    cache.append(0, [ids[2]], k0, v0)
    held[ids[2]].append((k0[0], v0[0]))
    order = [ids[2], ids[0], ids[1]]

    def cached(seq):
        if not held[seq]:
            return torch.zeros(2, 0, scheme.head_dim), torch.zeros(2, 0, scheme.head_dim)
        k, v = (torch.cat(parts, 1) for parts in zip(*held[seq]))
        if rotate:  # expected_dense reads unrotated inputs: the cache's own (rotated) contents, checked elsewhere
            return cache.dense(0, seq)
        return expected_dense(cache, k, v)

    for tokens in CHUNKS:
        k_new, v_new = check_chunk(cache, order, cached, rng, tokens)
        cache.append(0, order, k_new, v_new)
        for b, seq in enumerate(order):
            held[seq].append((k_new[b], v_new[b]))
    assert cache.quantized_tokens(cache.seq_len(ids[0])) >= 2 * cache.page_size  # pages were crossed


def test_attend_chunk_in_blocks_of_query_tokens(rng, monkeypatch):
    """A chunk whose scores exceed CHUNK_SCORES is attended in blocks of query tokens: the same result as one block."""
    scheme = SCHEMES[1]
    cache = make_cache(scheme)
    seq = cache.allocate()
    k, v = kv(rng, scheme, 1, 500)
    cache.append(0, [seq], k, v)
    q = torch.randn(1, 40, 4, scheme.head_dim, generator=rng).to(scheme.q_dtype)
    k_new, v_new = kv(rng, scheme, 1, 40)
    whole = cache.attend_chunk(0, [seq], q, k_new, v_new, return_lse=True)
    monkeypatch.setattr(foscar.cache, "CHUNK_SCORES", 4 * (16 + cache.ring + 384 + 40) * 7)  # blocks of 7 rows
    blocks = cache.attend_chunk(0, [seq], q, k_new, v_new, return_lse=True)
    assert torch.allclose(whole[0].float(), blocks[0].float(), atol=1e-2) and torch.allclose(whole[1], blocks[1],
                                                                                                 atol=1e-5)
    check_chunk(cache, [seq], lambda s: expected_dense(cache, k[0], v[0]), rng, 40)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_attend_chunk_as_a_kernel_cache_computes_it(arch, rng, monkeypatch):
    """A kernel cache keeps no fp32 copies: attend_chunk dequantizes its pages block by block into q's dtype and
    merges fused attentions (foscar.chunk_attention). That computation, run here on a CPU cache without its
    copies (the torch dequantizer in place of the kernel; each arch's bit order), in blocks of one page, is within
    the rule of float64 and close to the copies' fp32 result."""
    monkeypatch.setattr(foscar.cache, "BLOCK_BYTES", 1)  # one page per block
    scheme = SCHEMES[3]
    cache = make_cache(scheme, arch=arch)
    assert cache.arch.name == arch
    ids = [cache.allocate() for _ in range(2)]
    k, v = kv(rng, scheme, 2, 700)
    cache.append(0, ids, k, v)
    assert cache.quantized_tokens(700) > 2 * cache.page_size  # several blocks
    q = torch.randn(2, 9, 4, scheme.head_dim, generator=rng).to(scheme.q_dtype)
    k_new, v_new = kv(rng, scheme, 2, 9)
    with_copies = cache.attend_chunk(0, ids[::-1], q, k_new, v_new, return_lse=True)
    cache._dequantized = None  # what a use_kernels cache holds
    blocked = cache.attend_chunk(0, ids[::-1], q, k_new, v_new, return_lse=True)
    # (outputs in BF16: the two computations may round an element of magnitude 2-4 one ulp, 2^-6, apart)
    assert torch.allclose(with_copies[0].float(), blocked[0].float(), atol=1e-2, rtol=torch.finfo(torch.bfloat16).eps)
    assert torch.allclose(with_copies[1], blocked[1], atol=1e-2)
    check_chunk(cache, ids[::-1], lambda seq: cache.dense(0, seq), rng, 9)


def test_attend_chunk_errors_name_the_argument_and_leave_the_cache_unchanged(rng):
    scheme = SCHEMES[1]
    cache = make_cache(scheme, max_seqs=2)
    a, b = cache.allocate(), cache.allocate()
    k, v = kv(rng, scheme, 2, 400)
    cache.append(0, [a, b], k, v)
    snap = snapshot(cache)
    q = torch.zeros(2, 3, 4, 64, dtype=torch.bfloat16)
    k3, v3 = kv(rng, scheme, 2, 3)
    big_q = torch.zeros(2, 1101, 4, 64, dtype=torch.bfloat16)
    big_k, big_v = kv(rng, scheme, 2, 1101)
    bad = [
        (ValueError, r"q must have shape \[batch=2, tokens=3 \(k's\), heads=4, head_dim=64\], got \[2, 4, 3, 64\]",
         lambda: cache.attend_chunk(0, [a, b], q.transpose(1, 2), k3, v3)),
        (ValueError, r"q must have shape .* got \[2, 4, 64\]", lambda: cache.attend_chunk(0, [a, b], q[:, 0], k3, v3)),
        (ValueError, r"q must have shape .*tokens=2 \(k's\)", lambda: cache.attend_chunk(0, [a, b], q, k3[:, :, :2],
                                                                                        v3[:, :, :2])),
        (TypeError, "q must have dtype", lambda: cache.attend_chunk(0, [a, b], q.float(), k3, v3)),
        (TypeError, "q must be a torch.Tensor", lambda: cache.attend_chunk(0, [a, b], None, k3, v3)),
        (ValueError, "v must have the shape of k", lambda: cache.attend_chunk(0, [a, b], q, k3, v3[:, :, :2])),
        (ValueError, "k has 4 heads", lambda: cache.attend_chunk(0, [a, b], q, k3.repeat(1, 2, 1, 1), v3)),
        (ValueError, r"k must have shape \[batch=1", lambda: cache.attend_chunk(0, [a], q, k3, v3)),
        (ValueError, "seq_ids: unknown sequence id 3", lambda: cache.attend_chunk(0, [a, 3], q, k3, v3)),
        (ValueError, "layer must be", lambda: cache.attend_chunk(2, [a, b], q, k3, v3)),
        (ValueError, "sm_scale", lambda: cache.attend_chunk(0, [a, b], q, k3, v3, sm_scale=0.0)),
        (ValueError, r"q: 1101 new tokens after the 400 cached of a sequence exceed max_seq_len=1500",
         lambda: cache.attend_chunk(0, [a, b], big_q, big_k, big_v)),
    ]
    for error, message, call in bad:
        with pytest.raises(error, match=message):
            call()
        assert_unchanged(cache, snap)


class RingModel:
    """Which token each 16-bit ring slot holds, by the ring's definition alone: every appended token at position
    ``p >= sink`` is written to slot ``(p - sink) % ring``, in order; a truncate writes nothing."""

    def __init__(self, cache):
        self.cache, self.slots, self.tokens = cache, {}, []  # slot -> token id; position -> token id

    def append(self, count):
        for _ in range(count):
            p, token = len(self.tokens), object()
            self.tokens.append(token)
            if p >= self.cache.sink:
                self.slots[(p - self.cache.sink) % self.cache.ring] = token

    def truncate(self, count):
        del self.tokens[len(self.tokens) - count:]

    def rollback_limit(self):
        """The most tokens that can go: cut to m, the ring must hold tokens S + Q(m) .. m - 1 (and does, or not)."""
        c, n = self.cache, len(self.tokens)

        def restorable(m):
            return all(self.slots.get((p - c.sink) % c.ring) is self.tokens[p]
                       for p in range(c.sink + c.quantized_tokens(m), m))

        k = 0
        while k < n and restorable(n - k - 1):
            k += 1
        return k


def test_a_deep_copy_leaves_the_kept_dequantize_launchers(rng):
    """``copy.deepcopy`` of a cache (a view to truncate, a prompt cache reused): everything copied but the kept
    dequantize launchers (compiled-kernel handles and pointers into the original's pools, which cannot be copied);
    the copy holds what the original holds and builds its own launchers."""
    scheme = SCHEMES[0]
    cache = make_cache(scheme)
    seq = cache.allocate()
    k, v = kv(rng, scheme, 1, 700)
    cache.append(0, [seq], k, v)

    class Uncopyable:
        def __deepcopy__(self, memo):
            raise AssertionError("a kept launcher was copied")

    cache._dequantizers[(0, "k", torch.bfloat16)] = Uncopyable()
    view = copy.deepcopy(cache)
    assert view._dequantizers == {} and len(cache._dequantizers) == 1
    for got, want in zip(view.dense(0, seq), cache.dense(0, seq)):
        assert torch.equal(got, want)
    view.append(0, [seq], *kv(rng, scheme, 1, 5))
    assert view.seq_len(seq) == 705 and cache.seq_len(seq) == 700


@pytest.mark.parametrize("scheme", SCHEMES[:2] + SCHEMES[3:], ids=lambda s: s.name)
def test_truncate_equals_never_having_appended(scheme, rng):
    """A random walk of appends (one token, chunks shorter and longer than the window) and rollbacks of up to
    rollback_limit tokens, on two sequences of one batch: after every step each sequence is the one that was only
    appended what it holds (dense contents, lengths, attention equal to a cache that took those tokens at once),
    and rollback_limit is what the ring's definition allows (RingModel) after every append and rollback."""
    cache = make_cache(scheme, layers=1, num_pages=40, max_seqs=2)
    ids = [cache.allocate(), cache.allocate()]
    model = RingModel(cache)
    held_k = held_v = torch.zeros(2, 2, 0, scheme.head_dim, dtype=scheme.q_dtype)
    walk = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    cuts = steps = 0
    while steps < 60 or cuts < 5:  # the walk goes on until it has cut 5 times, so no seed leaves the test weaker
        steps += 1
        assert steps < 400, f"the walk cut {cuts} times in 400 steps"
        limit = cache.rollback_limit(ids[0])
        assert limit == model.rollback_limit() == cache.rollback_limit(ids[1]), len(model.tokens)
        room = cache.max_seq_len - held_k.shape[2]
        counts = [c for c in (1, 1, 3, 17, 64, 200) if c <= room]
        if limit and (not counts or float(torch.rand(1, generator=walk)) < 0.4):
            drop = int(torch.randint(1, limit + 1, (1,), generator=walk))
            cache.truncate(0, ids, drop)
            model.truncate(drop)
            held_k, held_v = held_k[:, :, :-drop], held_v[:, :, :-drop]
            cuts += 1
        else:
            assert counts, "the cache is full and nothing can be rolled back"
            count = counts[int(torch.randint(0, len(counts), (1,), generator=walk))]
            k, v = kv(rng, scheme, 2, count)
            cache.append(0, ids, k, v)
            model.append(count)
            held_k, held_v = torch.cat([held_k, k], 2), torch.cat([held_v, v], 2)
        fresh = make_cache(scheme, layers=1, max_seqs=2)
        fresh_ids = [fresh.allocate(), fresh.allocate()]
        fresh.append(0, fresh_ids, held_k, held_v) if held_k.shape[2] else None
        assert torch.equal(cache.lengths[:, :2], fresh.lengths[:, :2])
        for seq, twin in zip(ids, fresh_ids):
            assert all(torch.equal(x, y) for x, y in zip(cache.dense(0, seq), fresh.dense(0, twin))), cuts
        q = torch.randn(2, 2 * scheme.gqa_ratio, scheme.head_dim, generator=rng).to(scheme.q_dtype)
        assert torch.allclose(cache.attend(0, ids, q).float(), fresh.attend(0, fresh_ids, q).float(), atol=1e-2)


def test_rollback_limit_around_a_flush(rng):
    """sink 16, window 128, granule 64 (ring 192): the flush at 208 quantizes tokens 16 .. 79, whose slots stay
    until the ring wraps past them; each token after the flush at 272 reuses a slot of tokens 80 .. 143, so from
    280 a cut below 272 is refused, and after that cut the reused slots still count."""
    cache = make_cache(SCHEMES[1], layers=1)
    seq = cache.allocate()
    k, v = kv(rng, SCHEMES[1], 1, 300)
    cache.append(0, [seq], k[:, :, :208], v[:, :, :208])
    assert cache.quantized_tokens(208) == 64 and cache.rollback_limit(seq) == 208  # the ring has not wrapped
    cache.append(0, [seq], k[:, :, 208:272], v[:, :, 208:272])
    assert cache.quantized_tokens(272) == 128 and cache.rollback_limit(seq) == 64  # just flushed: 80 .. 143 may go back
    cache.append(0, [seq], k[:, :, 272:280], v[:, :, 272:280])
    assert cache.rollback_limit(seq) == 8
    with pytest.raises(ValueError, match=r"num_tokens=9: sequence 0 holds 280 tokens in layer 0 and can roll back "
                                         r"at most 8 \(rollback_limit\)"):
        cache.truncate(0, [seq], 9)
    cache.truncate(0, [seq], 8)
    assert cache.seq_len(seq) == 272 and cache.rollback_limit(seq) == 0  # tokens 80 .. 87's slots were reused
    cache.append(0, [seq], k[:, :, 272:274], v[:, :, 272:274])
    assert cache.rollback_limit(seq) == 2


def test_truncate_into_a_granule_a_chunk_quantized_on_append(rng):
    """A chunk from 10 to 272 tokens quantizes its own tokens 16 .. 143 as it appends them; the last granule's
    slots still hold them, so a cut to 208 returns 80 .. 143 to 16 bits: the same cache as appending 208 tokens."""
    scheme = SCHEMES[1]
    k, v = kv(rng, scheme, 1, 300)
    cut, fresh = make_cache(scheme, layers=1), make_cache(scheme, layers=1)
    for cache in (cut, fresh):
        cache.allocate()
    cut.append(0, [0], k[:, :, :10], v[:, :, :10])
    cut.append(0, [0], k[:, :, 10:272], v[:, :, 10:272])
    assert cut.rollback_limit(0) == 64
    cut.truncate(0, [0], 64)
    fresh.append(0, [0], k[:, :, :208], v[:, :, :208])
    for end in (209, 210, 300, None):  # then one token, one, a chunk that re-quantizes 80 .. 143
        assert all(torch.equal(x, y) for x, y in zip(cut.dense(0, 0), fresh.dense(0, 0))), cut.seq_len(0)
        for cache in (cut, fresh) if end else ():
            cache.append(0, [0], k[:, :, cache.seq_len(0):end], v[:, :, cache.seq_len(0):end])
    assert cut.seq_len(0) == 300 and cut.quantized_tokens(300) == 128


def test_truncate_errors_name_the_argument_and_leave_the_cache_unchanged(rng):
    scheme = SCHEMES[1]
    cache = make_cache(scheme, max_seqs=3)
    a, b, c = cache.allocate(), cache.allocate(), cache.allocate()
    k, v = kv(rng, scheme, 2, 600)
    cache.append(0, [a, b], k[:, :, :400], v[:, :, :400])
    cache.append(0, [b], k[1:, :, 400:], v[1:, :, 400:])  # b: 600 tokens, a: 400
    snap = snapshot(cache)
    limits = cache.rollback_limit(a), cache.rollback_limit(b)
    assert limits[1] < limits[0]
    bad = [
        (ValueError, rf"num_tokens={limits[1] + 1}: sequence {b} holds 600 tokens",  # a could, b cannot: neither is cut
         lambda: cache.truncate(0, [a, b], limits[1] + 1)),
        (ValueError, "num_tokens must be an int >= 0, got -1", lambda: cache.truncate(0, [a], -1)),
        (ValueError, "num_tokens must be an int >= 0, got True", lambda: cache.truncate(0, [a], True)),
        (ValueError, "num_tokens must be an int >= 0, got 1.0", lambda: cache.truncate(0, [a], 1.0)),
        (ValueError, rf"num_tokens=1: sequence {c} holds only 0 tokens in layer 0$", lambda: cache.truncate(0, [c], 1)),
        (ValueError, rf"num_tokens=401: sequence {a} holds only 400 tokens", lambda: cache.truncate(0, [a], 401)),
        (ValueError, "seq_ids: unknown sequence id 3", lambda: cache.truncate(0, [3], 1)),
        (ValueError, "layer must be", lambda: cache.truncate(2, [a], 1)),
    ]
    for error, message, call in bad:
        with pytest.raises(error, match=message):
            call()
        assert_unchanged(cache, snap)
    cache.truncate(1, [a], 0)  # nothing to remove, in a layer that holds nothing
    assert_unchanged(cache, snap)
    cache.truncate(0, [a, b], limits[1])
    assert cache.seq_len(a) == 400 - limits[1] and cache.seq_len(b) == 600 - limits[1]
    assert cache.pages_of(b) == snap[1][1][b]  # pages kept


def gpu_cache(scheme, rotate=False):
    return foscar.cache.PagedKVCache(scheme, 1, 2, 48, 3, 4096, sink=64, window=256, rotate=rotate, device="cuda")


GPU_SCHEMES = [Scheme.make(2, "channel", 128, "token", 128, 128, 4), Scheme.make(4, "token", 128, "token", 128, 128, 4),
               Scheme.make(2, "token", 128, "token", 128, 128, 4, q_dtype=torch.float16)]


def take_packed_pages_by(path: str, monkeypatch) -> list:
    """Route ``attend_chunk``'s packed pages one way: "prefill" (the prefill kernel), "decode" (the decode kernel)
    or "blocks" (dequantized blocks). Returns the list the prefill kernel's launches are counted in. The kernel's
    partial outputs are allocated NaN-poisoned, and every element must come back written (finite)."""
    import foscar.hopper.prefill

    monkeypatch.setattr(foscar.cache, "PREFILL_COLUMNS", 10**9 if path == "prefill" else 0)
    monkeypatch.setattr(foscar.cache, "DECODE_COLUMNS", 10**9 if path == "decode" else 0)
    launched, run, empty = [], foscar.hopper.prefill.run_prefill, torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    def counted(q_rows, *args):
        launched.append(tuple(q_rows.shape))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch, "empty", poisoned)
            out, lse = run(q_rows, *args)
        assert bool(out.isfinite().all()) and bool(lse.isfinite().all()), "a partial the kernel did not write"
        return out, lse

    monkeypatch.setattr(foscar.hopper.prefill, "run_prefill", counted)
    return launched


@pytest.mark.gpu
@pytest.mark.parametrize("packed_by", ["blocks", "decode", "prefill"])
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("scheme", GPU_SCHEMES, ids=lambda s: s.name)
def test_attend_chunk_on_a_kernel_cache(scheme, rotate, packed_by, rng, monkeypatch):
    """The kernel path's cache (no fp32 copies): chunks against float64 attention over what the cache holds (its
    dense(), read from the packed pages), chunks appended in turn. The packed pages either dequantized per call, in
    blocks of one page cut into pieces of 64 tokens (the dequantize kernel given page-table slices past the first
    page), attended by the decode kernel with the chunk's tokens as query heads (``PackedPrefix``: tiles of
    ``16 // gqa`` tokens, the last one padded), or by the prefill kernel (``PackedPrefill``: 128 query rows a CTA,
    the last row tile part-filled)."""
    prefilled = take_packed_pages_by(packed_by, monkeypatch)
    monkeypatch.setattr(foscar.cache, "BLOCK_BYTES", 1)
    monkeypatch.setattr(foscar.chunk_attention, "MIN_PIECE", 64)
    dequantized = []

    class Counted(foscar.cache.PagesDequantizer):
        def __call__(self, *args, **kwargs):
            dequantized.append(self.cfg)
            return super().__call__(*args, **kwargs)

    monkeypatch.setattr(foscar.cache, "PagesDequantizer", Counted)
    cache = gpu_cache(scheme, rotate)
    assert cache.use_kernels and cache._dequantized is None
    ids = [cache.allocate() for _ in range(3)]
    k0, v0 = kv(rng, scheme, 3, 500)
    cache.append(0, ids, k0.cuda(), v0.cuda())
    for tokens in CHUNKS:
        k_new, v_new = check_chunk(cache, ids[::-1], lambda seq: cache.dense(0, seq), rng, tokens)
        cache.append(0, ids[::-1], k_new.cuda(), v_new.cuda())
    assert bool(dequantized) == (packed_by == "blocks")  # the path asked for took the packed pages
    assert bool(prefilled) == (packed_by == "prefill")
    # one kept launcher per role (one layer, one dtype) served every block; a copy of the cache builds its own
    assert len(cache._dequantizers) == (2 if packed_by == "blocks" else 0)
    view = copy.deepcopy(cache)
    assert view._dequantizers == {}
    check_chunk(view, ids, lambda seq: view.dense(0, seq), rng, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", GPU_SCHEMES, ids=lambda s: s.name)
def test_the_prefill_kernel_over_a_long_prefix_in_splits(scheme, rng, monkeypatch):
    """The prefill kernel over prefixes of many tiles and pages, cut into splits (each a partial merged by its LSE),
    with one row tile part-filled and with several: against float64, the cache unchanged."""
    prefilled = take_packed_pages_by("prefill", monkeypatch)
    cache = foscar.cache.PagedKVCache(scheme, 1, 2, 96, 2, 8192, sink=64, window=256, device="cuda")
    ids = [cache.allocate() for _ in range(2)]
    k0, v0 = kv(rng, scheme, 2, 5000)
    cache.append(0, ids, k0.cuda(), v0.cuda())
    for tokens in (1, 7, 40, 100):
        check_chunk(cache, ids, lambda seq: cache.dense(0, seq), rng, tokens)
    assert len(prefilled) == 8 and prefilled[-1] == (2, 4 * 100, scheme.head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("gqa", [9, 16])
def test_attend_chunk_by_the_decode_kernel_at_one_token_per_tile(gqa, rng, monkeypatch):
    """gqa 9-16: ``PackedPrefix`` puts one chunk token per tile of 16 query columns, where folding q is a view; with
    the transposed q transformers passes, the kernel must still read rows densely (a strided q mixed KV heads'
    rows). Against float64, chunks crossing the sink, the window and pages."""
    take_packed_pages_by("decode", monkeypatch)
    monkeypatch.setattr(foscar.cache, "PagesDequantizer", lambda *a, **kw: pytest.fail("took the blocks path"))
    scheme = Scheme.make(2, "channel", 128, "token", 128, 128, gqa)
    cache = gpu_cache(scheme)
    ids = [cache.allocate() for _ in range(2)]
    k0, v0 = kv(rng, scheme, 2, 700)
    cache.append(0, ids, k0.cuda(), v0.cuda())
    for tokens in (2, 5, 16, 33):  # (one token: a transposed view is contiguous)
        k_new, v_new = check_chunk(cache, ids, lambda seq: cache.dense(0, seq), rng, tokens, transposed_q=True)
        cache.append(0, ids, k_new.cuda(), v_new.cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", GPU_SCHEMES, ids=lambda s: s.name)
def test_truncate_then_decode_on_a_kernel_cache(scheme, rng):
    """On the GPU, a rollback (crossing a flush where the ring allows it) then one-token appends and kernel attends
    equal a cache that never held the removed tokens, bit for bit."""
    k, v = kv(rng, scheme, 1, 1200)
    k, v = k.cuda(), v.cuda()
    probe = gpu_cache(scheme)
    n = next(n for n in range(700, 1200) if probe.quantized_tokens(n) > probe.quantized_tokens(n - 1))  # a flush
    cut, fresh = gpu_cache(scheme), gpu_cache(scheme)
    for cache in (cut, fresh):
        cache.allocate()
    cut.append(0, [0], k[:, :, :n - 1], v[:, :, :n - 1])
    cut.append(0, [0], k[:, :, n - 1:n], v[:, :, n - 1:n])
    drop = cut.rollback_limit(0)
    assert drop == cut.granule  # just flushed: the whole granule can go back
    cut.truncate(0, [0], drop)
    fresh.append(0, [0], k[:, :, :n - drop], v[:, :, :n - drop])
    for t in range(n - drop, n + 80):
        q = torch.randn(1, 2 * scheme.gqa_ratio, scheme.head_dim, generator=rng).to(scheme.q_dtype).cuda()
        assert torch.equal(cut.attend(0, [0], q), fresh.attend(0, [0], q)), t
        for cache in (cut, fresh):
            cache.append(0, [0], k[:, :, t:t + 1], v[:, :, t:t + 1])
    for x, y in zip(cut.dense(0, 0), fresh.dense(0, 0)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("sink, window", [(16, 128), (0, 128), (5, 256)])
def test_slot_runs_are_the_valid_slots_as_slices(sink, window):
    """``_slot_runs(n)`` (the chunk path's 16-bit slots, slices with no host sync) covers exactly the slots
    ``_valid_slots`` marks for every length, each once, through flushes and the ring's wrap."""
    cache = make_cache(sink=sink, window=window)
    for n in range(0, 1400, 7):
        n_dev = torch.tensor([n])
        valid = cache._valid_slots(n_dev, cache._quantized_tokens_dev(n_dev))[0].nonzero()[:, 0].tolist()
        covered = [j for run in cache._slot_runs(n) for j in range(run.start, run.stop)]
        assert sorted(covered) == valid, n
