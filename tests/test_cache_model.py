"""A model-based random test of foscar.cache.PagedKVCache (torch path, CPU) and foscar.batch.BatchAttention.

The reference keeps, per (layer, sequence), the plain list of appended (and not removed) K/V tokens, K rotated
and rounded to 16 bits as the cache stores it. What a sequence of n tokens should hold follows from that list
alone: sink and recent tokens exact, [S, S + Q(n)) as quantize_groups + dequantize_groups give it (granules are
quantized on their own, so this is a function of the list). After every operation:

* cache.dense(layer, seq) equals that, bit for bit, for every live (layer, seq);
* lengths (device and host) equal the list lengths; pages_for(max layer length) <= pages held;
* rollback_limit >= min(rollback, n) when the sequence only grew since it was allocated (the constructor's promise);

and every attend / attend_chunk / BatchAttention.run is compared against float64 attention over that reference
(lse within 2e-4, out within 1.5e-2), the cache unchanged by attend/attend_chunk. Refused calls (truncate past
rollback_limit, appends past the pool or max_seq_len, attend of more tokens than held) must leave the cache as it
was (snapshot of every tensor and host list).

Random configurations (the four schemes of tests/test_cache.py, 1-3 layers, sink 0..64, window 0..2 granules,
rollback 0..70, rotation on and off) and operations (allocate / free, appends of 1..300 tokens to shuffled subsets
of sequences on one layer, layers out of step, truncates up to the limit and past it, attends of 1-4 query tokens,
attend_chunk, BatchAttention plan/run), seeded: a failure names its seed and the last operations. Written by a
helper's audit (benchmarks/NOTES.md section 49): 300 seeds x 150 steps found no failure besides the rotation's
float16 range (fixed).
"""

import copy

import pytest
import torch

from foscar import Scheme
from foscar.batch import BatchAttention
from foscar.cache import PagedKVCache, PagePoolFull
from foscar.quantize import dequantize_groups, quantize_groups

SCHEMES = [
    Scheme.make(2, "channel", 128, "token", 64, 64, 2),  # granule 128
    Scheme.make(4, "token", 64, "token", 64, 64, 2),  # granule 64
    Scheme.make(2, "channel", 64, "channel", 32, 64, 1),
    Scheme.make(None, "channel", 64, "token", 32, 64, 2, k_bits=4, v_bits=2),
]
SM = 0.1
STEPS = 80  # per seed: ~2.5 s on 2 CPU cores
KVH = 2


class Failure(AssertionError):
    pass


def check(cond, *msg):
    if not cond:
        raise Failure(" ".join(str(m) for m in msg))


def snapshot(cache):
    names = ("k_codes", "k_params", "v_codes", "v_params", "k_bf16", "v_bf16", "lengths", "page_table")
    tensors = {n: getattr(cache, n).clone() for n in names}
    for role in "kv":
        tensors["deq" + role] = cache._dequantized[role].clone()
        tensors["slots" + role] = cache._slots_fp32[role].clone()
    host = (list(cache._free_pages), [None if p is None else list(p) for p in cache._pages],
            cache._host_len.clone(), cache._written.clone())
    return tensors, host


def same_snapshot(a, b):
    for name in a[0]:
        if not torch.equal(a[0][name], b[0][name]):
            return name
    if a[1][0] != b[1][0] or a[1][1] != b[1][1]:
        return "host pages"
    if not torch.equal(a[1][2], b[1][2]):
        return "host lengths"
    if not torch.equal(a[1][3], b[1][3]):
        return "_written"
    return None


class Fuzz:
    def __init__(self, seed, log=None):
        self.g = torch.Generator().manual_seed(seed)
        self.seed = seed
        self.log = [] if log is None else log
        self.scheme = SCHEMES[self.ri(0, len(SCHEMES) - 1)]
        T = 128 if self.scheme is SCHEMES[0] else 64
        self.layers = self.ri(1, 3)
        self.max_seqs = self.ri(2, 4)
        sink = [0, 1, 3, 16, 64][self.ri(0, 4)]
        window = [0, T, 2 * T][self.ri(0, 2)]
        rollback = [0, 0, 1, 5, 64, 70][self.ri(0, 5)]
        rotate = bool(self.ri(0, 1))
        num_pages = self.ri(4, 40)
        self.max_seq_len = self.ri(300, 1500)
        self.kw = dict(scheme=self.scheme, num_layers=self.layers, kv_heads=KVH, num_pages=num_pages,
                       max_seqs=self.max_seqs, max_seq_len=self.max_seq_len, sink=sink, window=window,
                       rotate=rotate, device="cpu", rollback=rollback)
        self.cache = PagedKVCache(**self.kw)
        self.ref = {}  # (layer, seq) -> (k [kvh, n, D] bf16 rotated, v)
        self.grew_only = {}  # seq -> whether no truncate since allocate (per layer)
        self.counts = {}
        self.say(f"PagedKVCache(**{ {k: (v.name if k == 'scheme' else v) for k, v in self.kw.items()} })")

    # -- helpers
    def ri(self, lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=self.g))

    def say(self, line):
        self.log.append(line)

    def count(self, what):
        self.counts[what] = self.counts.get(what, 0) + 1

    def rand_kv(self, batch, tokens):
        d = self.scheme.head_dim
        shape = (batch, KVH, tokens, d)
        k = torch.randn(shape, generator=self.g) + 2 * torch.randn(d, generator=self.g)
        return k.to(self.scheme.q_dtype), torch.randn(shape, generator=self.g).to(self.scheme.q_dtype)

    def rot(self, x):
        """Rotate the last dim as the cache does, token by token (CPU matmul is shape-independent here)."""
        c = self.cache
        if c.rotation is None:
            return x
        return (x.float() @ c.rotation).to(x.dtype)

    def live(self):
        return self.cache.sequences

    def n(self, layer, seq):
        return self.ref[layer, seq][0].shape[1]

    def expected(self, layer, seq):
        c = self.cache
        k, v = self.ref[layer, seq]
        s, qn = c.sink, c.quantized_tokens(k.shape[1])
        out = []
        for x, quant in ((k, c.scheme.k), (v, c.scheme.v)):
            parts = [x[:, :s].float()]
            if qn:
                codes, scale, offset = quantize_groups(x[:, s:s + qn], quant)
                parts.append(dequantize_groups(codes, scale, offset, quant))
            parts.append(x[:, s + qn:].float())
            out.append(torch.cat(parts, 1))
        return out

    def pick_ids(self, need=None):
        live = self.live()
        if need is not None:
            live = [s for s in live if need(s)]
        if not live:
            return None
        count = self.ri(1, len(live))
        perm = torch.randperm(len(live), generator=self.g).tolist()
        return [live[i] for i in perm[:count]]

    # -- invariants
    def check_state(self, where):
        c = self.cache
        for seq in self.live():
            for layer in range(self.layers):
                n = self.n(layer, seq)
                check(c.seq_len(seq, layer) == n, where, "host length", layer, seq, c.seq_len(seq, layer), n)
                check(int(c.lengths[layer, seq]) == n, where, "device length", layer, seq)
                got = c.dense(layer, seq)
                want = self.expected(layer, seq)
                for role, x, y in zip("kv", got, want):
                    if not torch.equal(x, y):
                        bad = (x != y).any(0).any(-1).nonzero().flatten().tolist()
                        raise Failure(f"{where}: dense {role} of layer {layer} seq {seq} (n={n}) differs at "
                                      f"positions {bad[:10]}{'...' if len(bad) > 10 else ''}")
                if self.grew_only[seq][layer]:
                    lim = c.rollback_limit(seq, layer)
                    check(lim >= min(c.rollback, n), where, "rollback_limit", lim, "< rollback", c.rollback, n)
            mx = max(self.n(layer, seq) for layer in range(self.layers))
            check(len(c.pages_of(seq)) >= c.pages_for(mx), where, "pages")
        # the fp32 copies of the slots follow the 16-bit slots (torch path)
        for role, bf in (("k", c.k_bf16), ("v", c.v_bf16)):
            check(torch.equal(c._slots_fp32[role], bf.float()), where, "fp32 slot copies differ from 16-bit slots")

    def attention_ref(self, q, k, v, causal_last):
        """float64 attention of q [L, Hq, D] (rotated, 16-bit) over k, v [kvh, n, D]; query i is token
        n - L + i when causal_last else every key."""
        L, hq, d = q.shape
        group = hq // KVH
        n = k.shape[1]
        qg = q.double().view(L, KVH, group, d)
        scores = torch.einsum("lhgd,hnd->lhgn", qg, k.double()) * SM
        if causal_last:
            pos = torch.arange(n)
            mask = pos[None, :] > (n - L + torch.arange(L))[:, None]  # [L, n]
            scores = scores.masked_fill(mask[:, None, None, :], -torch.inf)
        lse = torch.logsumexp(scores, -1)
        out = torch.einsum("lhgn,hnd->lhgd", torch.softmax(scores, -1).nan_to_num(0.0), v.double())
        return out.reshape(L, hq, d), lse.reshape(L, hq)

    def compare(self, where, out, lse, ref_out, ref_lse):
        empty = torch.isinf(ref_lse)
        check(bool((torch.isinf(lse) == empty).all()), where, "lse -inf pattern")
        if (~empty).any():
            e = float((lse[~empty].double() - ref_lse[~empty]).abs().max())
            check(e < 2e-4, where, "lse error", e)
        e = float((out.double() - ref_out).abs().max())
        check(e < 1.5e-2, where, "out error", e)

    # -- operations
    def op_allocate(self):
        c = self.cache
        num = self.ri(0, 400) if self.ri(0, 2) == 0 else 0
        snap = snapshot(c)
        try:
            seq = c.allocate(min(num, c.max_seq_len))
        except PagePoolFull:
            check(same_snapshot(snap, snapshot(c)) is None, "allocate refused but changed",
                  same_snapshot(snap, snapshot(c)))
            self.count("allocate refused")
            return
        self.say(f"s{seq} = cache.allocate({min(num, c.max_seq_len)})")
        for layer in range(self.layers):
            e = torch.zeros(KVH, 0, self.scheme.head_dim, dtype=self.scheme.q_dtype)
            self.ref[layer, seq] = (e, e.clone())
        self.grew_only[seq] = [True] * self.layers
        self.count("allocate")

    def op_free(self):
        live = self.live()
        if not live:
            return
        seq = live[self.ri(0, len(live) - 1)]
        self.cache.free(seq)
        self.say(f"cache.free({seq})")
        for layer in range(self.layers):
            del self.ref[layer, seq]
        del self.grew_only[seq]
        self.count("free")

    def token_count(self):
        c = self.cache
        T = c.granule
        r = self.ri(0, 9)
        if r < 3:
            return 1
        if r < 5:
            return self.ri(2, 4)
        if r < 7:  # land near a boundary
            return max(1, T + self.ri(-2, 2))
        return self.ri(1, 300)

    def op_append(self):
        c = self.cache
        ids = self.pick_ids()
        if ids is None:
            return
        layer = self.ri(0, self.layers - 1)
        tokens = self.token_count()
        k, v = self.rand_kv(len(ids), tokens)
        snap = snapshot(c)
        try:
            c.append(layer, ids, k, v)
        except (PagePoolFull, ValueError) as err:
            over = max(self.n(layer, s) for s in ids) + tokens > c.max_seq_len
            check(isinstance(err, PagePoolFull) or over, "unexpected refusal", err)
            diff = same_snapshot(snap, snapshot(c))
            check(diff is None, f"append refused ({err}) but changed {diff}")
            self.count("append refused")
            return
        self.say(f"cache.append({layer}, {ids}, *kv({len(ids)}, {tokens}))")
        kr = self.rot(k)
        for b, seq in enumerate(ids):
            rk, rv = self.ref[layer, seq]
            self.ref[layer, seq] = (torch.cat([rk, kr[b]], 1), torch.cat([rv, v[b]], 1))
        self.count("append 1" if tokens == 1 else "append many")
        self.count_boundaries(layer, ids, tokens)

    def count_boundaries(self, layer, ids, tokens):
        c = self.cache
        for seq in ids:
            n1 = self.n(layer, seq)
            n0 = n1 - tokens
            if c.quantized_tokens(n1) > c.quantized_tokens(n0):
                self.count("granule flush")
            if c.pages_for(n1) > c.pages_for(n0):
                self.count("page boundary")
            if n0 < c.sink <= n1 and c.sink:
                self.count("sink boundary")
            if (n0 - c.sink) // c.ring != (n1 - c.sink) // c.ring and n1 > c.sink:
                self.count("ring wrap")

    def op_truncate(self):
        c = self.cache
        ids = self.pick_ids()
        if ids is None:
            return
        layer = self.ri(0, self.layers - 1)
        limit = min(c.rollback_limit(s, layer) for s in ids)
        snap = snapshot(c)
        if self.ri(0, 5) == 0:  # past the limit: refused, nothing changes
            over = limit + self.ri(1, 3)
            try:
                c.truncate(layer, ids, over)
            except ValueError:
                diff = same_snapshot(snap, snapshot(c))
                check(diff is None, "truncate refused but changed", diff)
                self.count("truncate refused")
                return
            # accepted: must be because the real min holds it (limit is per seq; min over seqs)
            raise Failure(f"truncate({layer}, {ids}, {over}) accepted past min rollback_limit {limit}")
        if limit == 0:
            return
        r = self.ri(1, limit) if self.ri(0, 1) else limit
        c.truncate(layer, ids, r)
        self.say(f"cache.truncate({layer}, {ids}, {r})")
        for seq in ids:
            rk, rv = self.ref[layer, seq]
            self.ref[layer, seq] = (rk[:, :-r], rv[:, :-r])
            self.grew_only[seq][layer] = False
        self.count("truncate")
        if r >= c.granule:
            self.count("truncate >= granule")
        for seq in ids:
            n = self.n(layer, seq)
            if c.quantized_tokens(n) < c.quantized_tokens(n + r):
                self.count("truncate un-quantizes")

    def op_attend(self):
        c = self.cache
        layer = self.ri(0, self.layers - 1)
        ids = self.pick_ids()
        if ids is None:
            return
        held = min(self.n(layer, s) for s in ids)
        most = min(4, c.max_query_tokens())
        tokens = self.ri(1, most)
        hq, d = KVH * self.scheme.gqa_ratio, self.scheme.head_dim
        four_d = tokens > 1 or self.ri(0, 1)
        q = torch.randn(len(ids), tokens, hq, d, generator=self.g).to(self.scheme.q_dtype)
        snap = snapshot(c)
        if held < tokens:
            try:
                c.attend(layer, ids, q if four_d else q[:, 0], sm_scale=SM)
            except ValueError:
                check(same_snapshot(snap, snapshot(c)) is None, "attend refused but changed")
                self.count("attend refused")
                return
            if tokens > 1:
                raise Failure(f"attend of {tokens} tokens accepted with a sequence of {held}")
        out, lse = c.attend(layer, ids, q if four_d else q[:, 0], sm_scale=SM, return_lse=True)
        diff = same_snapshot(snap, snapshot(c))
        check(diff is None, "attend changed the cache", diff)
        self.say(f"cache.attend({layer}, {ids}, q[{len(ids)}, {tokens}])")
        if not four_d:
            out, lse = out[:, None], lse[:, None]
        qr = self.rot(q)
        for b, seq in enumerate(ids):
            k, v = self.expected(layer, seq)
            ref_out, ref_lse = self.attention_ref(qr[b], k, v, causal_last=True)
            self.compare(f"attend layer {layer} seq {seq} n={k.shape[1]} tokens={tokens} ids={ids}", out[b], lse[b],
                         ref_out, ref_lse)
        self.count(f"attend {tokens}")

    def op_attend_chunk(self):
        c = self.cache
        layer = self.ri(0, self.layers - 1)
        ids = self.pick_ids()
        if ids is None:
            return
        tokens = self.ri(1, 4) if self.ri(0, 1) else self.ri(5, 200)
        if max(self.n(layer, s) for s in ids) + tokens > c.max_seq_len:
            return
        hq, d = KVH * self.scheme.gqa_ratio, self.scheme.head_dim
        q = torch.randn(len(ids), tokens, hq, d, generator=self.g).to(self.scheme.q_dtype)
        k, v = self.rand_kv(len(ids), tokens)
        snap = snapshot(c)
        out, lse = c.attend_chunk(layer, ids, q, k, v, sm_scale=SM, return_lse=True)
        diff = same_snapshot(snap, snapshot(c))
        check(diff is None, "attend_chunk changed the cache", diff)
        self.say(f"cache.attend_chunk({layer}, {ids}, q, *kv({len(ids)}, {tokens}))")
        qr, kr = self.rot(q), self.rot(k)
        for b, seq in enumerate(ids):
            ek, ev = self.expected(layer, seq)
            ref_out, ref_lse = self.attention_ref(qr[b], torch.cat([ek, kr[b].float()], 1),
                                                  torch.cat([ev, v[b].float()], 1), causal_last=True)
            self.compare(f"attend_chunk layer {layer} seq {seq} n={ek.shape[1]} tokens={tokens}", out[b], lse[b],
                         ref_out, ref_lse)
        self.count("attend_chunk")
        # sometimes append what was attended (as a chunked prefill does)
        if self.ri(0, 1):
            try:
                c.append(layer, ids, k, v)
            except PagePoolFull:
                return
            self.say(f"cache.append({layer}, {ids}, k_chunk, v_chunk)")
            for b, seq in enumerate(ids):
                rk, rv = self.ref[layer, seq]
                self.ref[layer, seq] = (torch.cat([rk, kr[b]], 1), torch.cat([rv, v[b]], 1))
            self.count_boundaries(layer, ids, tokens)

    def op_batch(self):
        c = self.cache
        ids = self.pick_ids()
        if ids is None:
            return
        lens = [[1, 1, 2, 3, 4, 7, 65, 130][self.ri(0, 7)] for _ in ids]
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        w = BatchAttention(c)
        snap = snapshot(c)
        try:
            w.plan(ids, offsets)
        except (PagePoolFull, ValueError) as err:
            diff = same_snapshot(snap, snapshot(c))
            check(diff is None, f"plan refused ({err}) but changed {diff}")
            self.count("plan refused")
            return
        self.say(f"w = BatchAttention(cache); w.plan({ids}, {offsets})")
        layers = list(range(self.layers))
        if self.ri(0, 1):
            layers = [layers[i] for i in torch.randperm(len(layers), generator=self.g).tolist()]
        hq, d = KVH * self.scheme.gqa_ratio, self.scheme.head_dim
        for layer in layers:
            total = offsets[-1]
            q = torch.randn(total, hq, d, generator=self.g).to(self.scheme.q_dtype)
            k, v = self.rand_kv(1, total)
            k, v = k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()
            before = {s: self.expected(layer, s) for s in ids}
            out, lse = w.run(layer, q, k, v, sm_scale=SM, return_lse=True)
            self.say(f"w.run({layer}, q, k, v)")
            qr, kr = self.rot(q), self.rot(k)
            for b, seq in enumerate(ids):
                a, e = offsets[b], offsets[b + 1]
                nk, nv = kr[a:e].transpose(0, 1), v[a:e].transpose(0, 1)
                rk, rv = self.ref[layer, seq]
                self.ref[layer, seq] = (torch.cat([rk, nk], 1), torch.cat([rv, nv], 1))
                if e - a <= c.max_query_tokens():  # appended, then attended: the cache as it holds them now
                    ek, ev = self.expected(layer, seq)
                else:  # attended over what it held, then appended
                    ek, ev = (torch.cat([x, y.float()], 1) for x, y in zip(before[seq], (nk, nv)))
                ref_out, ref_lse = self.attention_ref(qr[a:e], ek, ev, causal_last=True)
                self.compare(f"BatchAttention layer {layer} seq {seq} new={e - a}", out[a:e], lse[a:e], ref_out,
                             ref_lse)
            self.count_boundaries(layer, ids, 0)
            for seq, n in zip(ids, lens):
                self.count_boundaries(layer, [seq], 0)
        self.count("batch step")

    def op_deepcopy(self):
        self.cache = copy.deepcopy(self.cache)
        self.say("cache = copy.deepcopy(cache)")
        self.count("deepcopy")

    def step(self):
        ops = [(self.op_allocate, 2), (self.op_free, 1), (self.op_append, 10), (self.op_truncate, 5),
               (self.op_attend, 5), (self.op_attend_chunk, 2), (self.op_batch, 2), (self.op_deepcopy, 0.2)]
        if not self.live():
            ops = [(self.op_allocate, 1)]
        weights = torch.tensor([float(w) for _, w in ops])
        op = ops[int(torch.multinomial(weights, 1, generator=self.g))][0]
        op()
        self.check_state(op.__name__)


@pytest.mark.parametrize("seed", range(8))
def test_the_cache_holds_and_attends_what_its_tokens_give(seed):
    fuzz = Fuzz(seed)
    try:
        for _ in range(STEPS):
            fuzz.step()
    except Failure as err:
        raise AssertionError(f"seed {seed}: {err}; the last operations:\n" + "\n".join(fuzz.log[-12:])) from None
