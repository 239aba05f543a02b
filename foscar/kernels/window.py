"""BF16 sink + recent-window attention fused with the split-KV merge (CuTe DSL, SIMT).

``foscar.cache.PagedKVCache`` keeps the first ``S`` tokens of a sequence and its most recent ones
in BF16 slots (``[max_seqs, kv_heads, L, D]``, ``L = S + ring``) and the rest quantized. ``attend``
runs the quantized kernel with partial outputs (``o_s``, ``lse_s`` per split); this kernel attends
each query row over its sequence's valid BF16 slots and merges that with the quantized splits by
log-sum-exp, in one launch (instead of ~25 small torch launches)::

    lse = log(sum_s exp(lse_s) + exp(lse_w))     o = sum_s exp(lse_s - lse) o_s + exp(lse_w - lse) o_w

Slot ``j`` of a sequence of ``n`` tokens of which ``Q`` are quantized is valid when ``j < S`` and
``j < n`` (sink), or ``j >= S`` and ``(j - S - Q) mod ring < max(n - S - Q, 0)`` (the ring of
recent tokens, ``foscar.cache``). With ``Q = 0`` the quantized splits are ignored.

One CTA per (sequence, query head), 4 warps: lane ``4*t + c`` of warp ``w`` takes the slots
``32*i + 8*w + t`` and channels ``[c*D/4, (c+1)*D/4)``. Scores reduce over ``c`` (2 shuffles);
the softmax max and sum over ``t`` (shuffles) and the warps (shared memory); each thread sums
``p * v`` over its slots and channels, and the warps' partial outputs meet in shared memory, where
thread ``x`` merges channel ``x`` (and ``x + 128``) with the quantized splits. FP32 throughout.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..device import LOG2E, NEG_INF, fsel
from ..jit import cached_compile, current_stream, device_arch, fake_ptr, gmem_ptr
from ..softmax import finite_reference, lse_weight, merged_lse, normalize

__all__ = ["WindowMerge", "compile_window_merge", "window_merge"]

WARPS = 4
THREADS = 32 * WARPS
SLOTS_PER_STEP = 8 * WARPS  # 8 slots per warp per step


class WindowMerge:
    """See the module docstring. Compile-time: head_dim, slots L, GQA ratio, q/out dtype."""

    def __init__(self, head_dim: int, slots: int, gqa_ratio: int, q_dtype=cutlass.BFloat16):
        if head_dim % 32 or head_dim > 2 * THREADS:
            raise ValueError(f"head_dim must be a multiple of 32 and at most {2 * THREADS}, got {head_dim}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.D = head_dim
        self.L = slots
        self.R = gqa_ratio
        self.q_dtype = q_dtype
        self.DC = head_dim // 4  # channels per lane
        self.steps = -(-slots // SLOTS_PER_STEP)

    @cute.jit
    def __call__(
        self,
        q: cute.Pointer,  # [B, Hq, D] q dtype
        k_win: cute.Pointer,  # bf16 [max_seqs, kv_heads, L, D]
        v_win: cute.Pointer,
        rows: cute.Pointer,  # int64 [B]: slot row of each sequence
        n_tokens: cute.Pointer,  # int64 [B]
        n_quant: cute.Pointer,  # int64 [B]
        o_part: cute.Pointer,  # fp32 [B, Hq, splits, D]
        lse_part: cute.Pointer,  # fp32 [B, Hq, splits]
        out: cute.Pointer,  # [B, Hq, D] q dtype
        lse: cute.Pointer,  # fp32 [B, Hq]
        batch: Int32,
        q_heads: Int32,
        splits: Int32,
        sink: Int32,
        ring: Int32,
        sm_scale: Float32,
        stream: cuda.CUstream,
    ):
        D = self.D

        @cute.struct
        class SharedStorage:
            stats: cute.struct.Align[cute.struct.MemRange[Float32, 2 * WARPS], 16]  # per warp: max, sum
            acc: cute.struct.Align[cute.struct.MemRange[Float32, WARPS * D], 16]  # per warp: sum p*v

        self.kernel(SharedStorage, q, k_win, v_win, rows, n_tokens, n_quant, o_part, lse_part, out, lse, q_heads, splits,
                    sink, ring, sm_scale * LOG2E).launch(
            grid=[batch * q_heads, 1, 1], block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        SharedStorage: cutlass.Constexpr,
        q: cute.Pointer,
        k_win: cute.Pointer,
        v_win: cute.Pointer,
        rows: cute.Pointer,
        n_tokens: cute.Pointer,
        n_quant: cute.Pointer,
        o_part: cute.Pointer,
        lse_part: cute.Pointer,
        out: cute.Pointer,
        lse: cute.Pointer,
        q_heads: Int32,
        splits: Int32,
        sink: Int32,
        ring: Int32,
        scale_log2: Float32,
    ):
        D, L, DC = self.D, self.L, self.DC
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()  # b * q_heads + hq
        warp = tidx // 32
        lane = tidx % 32
        t = lane // 4
        c = lane % 4
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        stats = storage.stats.get_tensor(cute.make_layout(2 * WARPS))
        sacc = storage.acc.get_tensor(cute.make_layout((D, WARPS)))  # (channel, warp)

        b = row // q_heads
        kvh = (row % q_heads) // self.R
        n_b = Int32(scalar(n_tokens, b, Int64))
        q_b = Int32(scalar(n_quant, b, Int64))
        recent = cutlass.max(n_b - sink - q_b, 0)
        kv_row = (scalar(rows, b, Int64) * (q_heads // self.R) + kvh) * L  # first slot of (sequence, kv head)

        # ---------------------------------------------------------------- scores (log2 domain)
        qv = cute.make_rmem_tensor((DC,), Float32)
        qsrc = cute.make_tensor(q + (row.to(Int64) * D + c * DC), cute.make_layout((DC,)))
        for j in cutlass.range_constexpr(DC):
            qv[j] = qsrc[j].to(Float32)
        s = cute.make_rmem_tensor((self.steps,), Float32)
        m = Float32(NEG_INF)
        for i in cutlass.range_constexpr(self.steps):
            slot = SLOTS_PER_STEP * i + 8 * warp + t
            rel = (slot - sink - q_b) % ring
            rel = rel + select_i32(rel < 0, ring, 0)  # floor mod
            valid = (slot < L) & select_pred(slot < sink, slot < n_b, rel < recent)
            kvec = load_channels(k_win, (kv_row + cutlass.min(slot, L - 1)) * D + c * DC, DC)
            dot = Float32(0.0)
            for j in cutlass.range_constexpr(DC):
                dot = dot + qv[j] * kvec[j]
            for offset in (1, 2):
                dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=offset)
            s[i] = fsel(valid, dot * scale_log2, Float32(NEG_INF))
            m = cute.arch.fmax(m, s[i])
        for offset in (4, 8, 16):
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=offset))
        if lane == 0:
            stats[warp] = m
        cute.arch.sync_threads()
        m_all = cute.arch.fmax(cute.arch.fmax(stats[0], stats[1]), cute.arch.fmax(stats[2], stats[3]))
        m_ref = finite_reference(m_all)  # no valid slot: every p is 0

        # ---------------------------------------------------------------- p, sum p, sum p*v
        acc = cute.make_rmem_tensor((DC,), Float32)
        acc.fill(0.0)
        l_sum = Float32(0.0)
        for i in cutlass.range_constexpr(self.steps):
            slot = SLOTS_PER_STEP * i + 8 * warp + t
            p = cute.math.exp2(s[i] - m_ref, fastmath=True)
            l_sum = l_sum + p
            vvec = load_channels(v_win, (kv_row + cutlass.min(slot, L - 1)) * D + c * DC, DC)
            for j in cutlass.range_constexpr(DC):
                acc[j] = acc[j] + p * vvec[j]
        for offset in (4, 8, 16):  # over t: the lanes of one channel block
            l_sum = l_sum + cute.arch.shuffle_sync_bfly(l_sum, offset=offset)
            for j in cutlass.range_constexpr(DC):
                acc[j] = acc[j] + cute.arch.shuffle_sync_bfly(acc[j], offset=offset)
        if t == 0:
            for j in cutlass.range_constexpr(DC):
                sacc[c * DC + j, warp] = acc[j]
        if lane == 0:
            stats[WARPS + warp] = l_sum
        cute.arch.sync_threads()

        # ---------------------------------------------------------------- merge with the splits
        l_w = stats[WARPS] + stats[WARPS + 1] + stats[WARPS + 2] + stats[WARPS + 3]
        inv_l_w, lse_w = normalize(l_w, m_all)
        use_splits = q_b > 0
        m_top = lse_w
        for sp in cutlass.range(splits, unroll=1):
            lse_s = scalar(lse_part, row.to(Int64) * splits + sp, Float32)
            m_top = fsel(use_splits, cute.arch.fmax(m_top, lse_s), m_top)
        m_top_ref = finite_reference(m_top)
        w_w = lse_weight(lse_w, m_top_ref)
        n_ch = -(-D // THREADS)
        o_acc = cute.make_rmem_tensor((n_ch,), Float32)
        for x in cutlass.range_constexpr(n_ch):
            d = cutlass.min(tidx + THREADS * x, D - 1)
            o_acc[x] = w_w * inv_l_w * (sacc[d, 0] + sacc[d, 1] + sacc[d, 2] + sacc[d, 3])
        w_total = w_w
        for sp in cutlass.range(splits, unroll=1):
            lse_s = scalar(lse_part, row.to(Int64) * splits + sp, Float32)
            if use_splits and lse_s > Float32(NEG_INF):
                w_s = lse_weight(lse_s, m_top_ref)
                w_total = w_total + w_s
                for x in cutlass.range_constexpr(n_ch):
                    d = cutlass.min(tidx + THREADS * x, D - 1)
                    o_acc[x] = o_acc[x] + w_s * scalar(o_part, (row.to(Int64) * splits + sp) * D + d, Float32)
        inv_total = fsel(w_total > Float32(0.0), cute.arch.rcp_approx(w_total), Float32(0.0))
        for x in cutlass.range_constexpr(n_ch):
            d = tidx + THREADS * x
            if d < D:
                dst = cute.make_tensor(out + (row.to(Int64) * D + d), cute.make_layout((1,)))
                dst[0] = (o_acc[x] * inv_total).to(self.q_dtype)
        if tidx == 0:
            total_lse = merged_lse(m_top_ref, w_total)
            cute.make_tensor(lse + row, cute.make_layout((1,)))[0] = total_lse


def scalar(ptr, idx, dtype):
    """ptr[idx] as ``dtype``."""
    return cute.make_tensor(ptr + idx, cute.make_layout((1,)))[0].to(dtype)


def select_i32(cond, a, b):
    """Int32 ``cond ? a : b``, branch-free."""
    return Int32(cutlass.select_(cond, Int32(a), Int32(b)))


def select_pred(cond, a, b):
    """Predicate ``cond ? a : b``, branch-free."""
    return cutlass.select_(cond, a, b)


def load_channels(ptr, offset, count: int):
    """``count`` consecutive bf16 channels at element ``offset`` -> fp32 register tensor (vector loads)."""
    src = cute.make_tensor(ptr + offset, cute.make_layout((count,)))
    raw = cute.make_rmem_tensor((count,), cutlass.BFloat16)
    cute.autovec_copy(src, raw)
    vals = cute.make_rmem_tensor((count,), Float32)
    vals.store(raw.load().to(Float32))
    return vals


def compile_window_merge(head_dim: int, slots: int, gqa_ratio: int, arch: str = "sm_90a", q_dtype=cutlass.BFloat16):
    """Compile (no GPU needed) for ``arch`` with PTX and cubin kept; see ``foscar.inspect``."""
    from ..inspect import compile_for

    i32 = Int32(1)
    return compile_for(
        arch,
        WindowMerge(head_dim, slots, gqa_ratio, q_dtype),
        fake_ptr(q_dtype),
        fake_ptr(cutlass.BFloat16),
        fake_ptr(cutlass.BFloat16),
        fake_ptr(Int64),
        fake_ptr(Int64),
        fake_ptr(Int64),
        fake_ptr(Float32),
        fake_ptr(Float32),
        fake_ptr(q_dtype),
        fake_ptr(Float32),
        i32, i32, i32, i32, i32,
        Float32(1.0),
        cuda.CUstream(0),
    )


def window_merge(q, k_win, v_win, rows, n_tokens, n_quant, sink: int, o_part, lse_part, sm_scale: float, out=None, lse=None):
    """Attend ``q [B, Hq, D]`` over the BF16 slots ``k_win, v_win [max_seqs, kv_heads, L, D]`` of
    sequences ``rows`` (int64 [B]) with ``n_tokens`` / ``n_quant`` (int64 [B]) tokens in all / quantized,
    and merge with the quantized kernel's split partials ``o_part [B, Hq, S, D]``, ``lse_part
    [B, Hq, S]`` (fp32). Returns ``(out, lse)``: q's dtype [B, Hq, D] and fp32 [B, Hq]."""
    import torch

    batch, q_heads, d = q.shape
    max_seqs, kv_heads, slots, _ = k_win.shape
    splits = o_part.shape[2]
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(batch, q_heads, dtype=torch.float32, device=q.device) if lse is None else lse
    checks = (("q", q, (torch.bfloat16, torch.float16), (batch, q_heads, d)),
              ("k_win", k_win, (torch.bfloat16,), (max_seqs, kv_heads, slots, d)),
              ("v_win", v_win, (torch.bfloat16,), (max_seqs, kv_heads, slots, d)),
              ("rows", rows, (torch.int64,), (batch,)),
              ("n_tokens", n_tokens, (torch.int64,), (batch,)),
              ("n_quant", n_quant, (torch.int64,), (batch,)),
              ("o_part", o_part, (torch.float32,), (batch, q_heads, splits, d)),
              ("lse_part", lse_part, (torch.float32,), (batch, q_heads, splits)),
              ("out", out, (q.dtype,), (batch, q_heads, d)),
              ("lse", lse, (torch.float32,), (batch, q_heads)))
    for name, t, dtypes, shape in checks:
        if t.dtype not in dtypes or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{name}: need a contiguous {dtypes} tensor of shape {shape}, got "
                             f"{t.dtype} {tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}")
    for name, t, _, _ in checks:
        if t.device != q.device or not t.is_cuda:
            raise ValueError(f"{name}: must be on q's CUDA device, got {t.device} (q on {q.device})")
    if q_heads % kv_heads:
        raise ValueError(f"q heads {q_heads} must be a multiple of kv_heads {kv_heads}")
    if not 0 <= sink <= slots:
        raise ValueError(f"sink must be in [0, {slots}], got {sink}")
    if batch == 0:
        return out, lse
    q_type = cutlass.BFloat16 if q.dtype == torch.bfloat16 else cutlass.Float16
    gqa = q_heads // kv_heads
    arch = device_arch(q.device)
    compiled = cached_compile(("window_merge", d, slots, gqa, q_type, arch),
                              lambda: compile_window_merge(d, slots, gqa, arch, q_type))
    compiled(gmem_ptr(q, q_type), gmem_ptr(k_win, cutlass.BFloat16), gmem_ptr(v_win, cutlass.BFloat16),
             gmem_ptr(rows, Int64), gmem_ptr(n_tokens, Int64), gmem_ptr(n_quant, Int64), gmem_ptr(o_part, Float32),
             gmem_ptr(lse_part, Float32), gmem_ptr(out, q_type), gmem_ptr(lse, Float32), Int32(batch),
             Int32(q_heads), Int32(splits), Int32(sink), Int32(slots - sink), Float32(float(sm_scale)),
             current_stream(q.device))
    return out, lse
