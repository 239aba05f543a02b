"""Merge of a chunk's partial attentions by their log-sum-exp in one launch (``foscar.chunk_attention``; CuTe DSL,
SIMT, one kernel for both arches).

A chunk of ``L`` new tokens over a cached prefix is attended in parts (the prefix's blocks, their pieces, the 16-bit
slots, the chunk itself), each a normalized ``o_p`` with its ``lse_p`` over disjoint tokens. The exact merge of a
row is ``lse = log(sum_p exp(lse_p))``, ``o = sum_p exp(lse_p - lse) * o_p``. Torch ops take a few passes over an
FP32 running sum per part (a multiply, an ``addcmul``, the final transpose and cast: ~250 us of GPU time at a 1K
chunk of Qwen3-8B, benchmarks/NOTES.md section 45); this kernel reads each part once and writes the result where
the caller wants it.

Rows: a row is (KV head, query head ``g`` of its group, token ``t``). A part is ``o_p [kv_heads, gqa, L, D]``
(the query's dtype, or fp32) with ``lse_p [kv_heads, gqa, L]`` (fp32, natural log; -inf where the part has no
token), each at any strides (o's channels contiguous): the fused attentions' outputs, their pieces and slices are views, not copies. The parts come as a table (int64 ``[P, FIELDS]`` on the device, :func:`part_table`): o's
address and its (KV head, group head, token) strides in elements, lse's, and whether o is fp32. The output
``out`` (its dtype a compile-time choice) and ``lse`` go to any strides of (KV head, query head of the group,
token): the final ``[L, Hq, D]`` / ``[L, Hq]``, or an fp32 ``[kv_heads, gqa, L, D]`` part of a later merge.

One warp per row; lane ``l`` owns channels ``[l * D/32, (l + 1) * D/32)``. Pass 1 takes the row's max lse; pass
2 the weighted sum (the lses are a few L1 lines).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.typing import AddressSpace

from ..device import NEG_INF, at, fsel, store
from ..jit import cached_compile, device_arch, fake_ptr, half_type, launch
from ..scheme import HEAD_DIMS
from ..softmax import finite_reference, lse_weight, merged_lse

__all__ = ["FIELDS", "MergeParts", "compile_merge_parts", "merge_parts", "part_table"]

FIELDS = 9  # int64 per part: o's address and (KV head, group head, token) strides, lse's, whether o is fp32
WARPS = 8  # rows per CTA


class MergeParts:
    """The merge of ``parts`` parts into ``out`` (``out_dtype``) and ``lse`` (fp32); see the module docstring."""

    def __init__(self, head_dim: int, part_dtype, out_dtype):
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
        self.head_dim, self.vec = head_dim, head_dim // 32
        self.part_dtype, self.out_dtype = part_dtype, out_dtype

    @cute.jit
    def __call__(self, table: cute.Pointer, parts: Int32, kv_heads: Int32, gqa: Int32, tokens: Int32,
                 out: cute.Pointer, out_kv: Int32, out_g: Int32, out_t: Int32, lse: cute.Pointer, lse_kv: Int32,
                 lse_g: Int32, lse_t: Int32, stream: cuda.CUstream):
        rows = kv_heads * gqa * tokens
        # (parts, FIELDS)
        mTable = cute.make_tensor(table, cute.make_ordered_layout((parts, FIELDS), (1, 0)))
        self.kernel(mTable, parts, gqa, tokens, rows, out, out_kv, out_g, out_t, lse, lse_kv, lse_g, lse_t).launch(
            grid=[(rows + WARPS - 1) // WARPS, 1, 1], block=[32 * WARPS, 1, 1], stream=stream)

    @cute.jit
    def _part_lse(self, mTable: cute.Tensor, p, kv, g, t):
        """Part ``p``'s lse of the row (KV head ``kv``, group head ``g``, token ``t``)."""
        lse_ptr = cute.make_ptr(Float32, mTable[p, 4], AddressSpace.gmem, assumed_align=4)
        return at(lse_ptr, Int64(kv) * mTable[p, 5] + Int64(g) * mTable[p, 6] + Int64(t) * mTable[p, 7])

    @cute.jit
    def _load(self, dtype, mTable: cute.Tensor, p, element, acc: cute.Tensor, weight):
        """``acc += weight * o_p[...]``: this lane's ``vec`` channels of part ``p`` at ``element`` (its offset)."""
        src = cute.make_ptr(dtype, mTable[p, 0] + element * (dtype.width // 8), AddressSpace.gmem,
                            assumed_align=self.vec * dtype.width // 8)
        values = cute.make_rmem_tensor((self.vec,), dtype)
        cute.autovec_copy(cute.make_tensor(src, cute.make_layout((self.vec,))), values)
        for c in cutlass.range_constexpr(self.vec):
            acc[c] += weight * Float32(values[c])

    @cute.kernel
    def kernel(self, mTable: cute.Tensor, parts: Int32, gqa: Int32, tokens: Int32, rows: Int32, out: cute.Pointer,
               out_kv: Int32, out_g: Int32, out_t: Int32, lse: cute.Pointer, lse_kv: Int32, lse_g: Int32, lse_t: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        lane, row = tidx % 32, block * WARPS + tidx // 32
        if row < rows:
            per_head = gqa * tokens
            kv, g, t = row // per_head, row % per_head // tokens, row % tokens
            m = Float32(NEG_INF)
            for p in cutlass.range(parts, unroll=1):
                m = cute.arch.fmax(m, self._part_lse(mTable, p, kv, g, t))
            acc = cute.make_rmem_tensor((self.vec,), Float32)
            acc.fill(0.0)
            total = Float32(0.0)
            for p in cutlass.range(parts, unroll=1):
                weight = lse_weight(self._part_lse(mTable, p, kv, g, t), finite_reference(m))  # (no part: weight 0)
                total += weight
                # (this lane's channels of the row)
                element = (Int64(kv) * mTable[p, 1] + Int64(g) * mTable[p, 2] + Int64(t) * mTable[p, 3]
                           + Int64(lane * self.vec))
                if mTable[p, 8] != 0:
                    self._load(Float32, mTable, p, element, acc, weight)
                else:
                    self._load(self.part_dtype, mTable, p, element, acc, weight)
            cute.arch.sync_warp()  # every lane's reads of the row (out may be a part) before any lane writes it
            inv = fsel(total > Float32(0.0), cute.arch.rcp_approx(total), Float32(0.0))
            result = cute.make_rmem_tensor((self.vec,), self.out_dtype)
            result.store((acc.load() * inv).to(self.out_dtype))
            element = Int64(kv) * out_kv + Int64(g) * out_g + Int64(t) * out_t + Int64(lane * self.vec)
            width = self.out_dtype.width // 8
            dst = cute.make_ptr(self.out_dtype, out.toint() + element * width, AddressSpace.gmem,
                                assumed_align=self.vec * width)
            cute.autovec_copy(result, cute.make_tensor(dst, cute.make_layout((self.vec,))))
            if lane == 0:
                store(lse, Int64(kv) * lse_kv + Int64(g) * lse_g + Int64(t) * lse_t, merged_lse(m, total))


def compile_merge_parts(head_dim: int, part_dtype, out_dtype, arch: str = "sm_90a"):
    """Compile (no GPU needed) for ``arch`` with PTX and cubin kept (``foscar.inspect``)."""
    from ..inspect import compile_for

    i32 = Int32(1)
    return compile_for(arch, MergeParts(head_dim, part_dtype, out_dtype), fake_ptr(Int64), i32, i32, i32, i32,
                       fake_ptr(out_dtype), i32, i32, i32, fake_ptr(Float32), i32, i32, i32, cuda.CUstream(0))


def part_table(parts, device):
    """The device table (int64 ``[P, FIELDS]``) of ``parts``: ``(o [kv_heads, gqa, L, D], lse [kv_heads, gqa, L])``
    views (o in the query's dtype or fp32), copied from pinned memory without a host sync. A view the kernel's
    vector loads cannot take (channels not contiguous, an address or stride not a multiple of D/32 elements) is a
    ValueError naming the part."""
    import torch

    rows = []
    for index, (o, lse) in enumerate(parts):
        vec = o.shape[-1] // 32
        if o.stride(-1) != 1 or o.data_ptr() % (vec * o.element_size()) or any(x % vec for x in o.stride()[:3]):
            raise ValueError(f"parts[{index}]: o of strides {o.stride()} at {o.data_ptr():#x} is not a view the merge "
                             f"kernel loads {vec} channels at a time from")
        rows.append([o.data_ptr(), *o.stride()[:3], lse.data_ptr(), *lse.stride(), int(o.dtype == torch.float32)])
    return torch.tensor(rows, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)


def merge_parts(parts, out, lse) -> None:
    """Merge ``parts`` (:func:`part_table`'s list, each part's o in fp32 or one 16-bit dtype, ``out``'s where that is
    16-bit; every lse finite) into ``out [kv_heads, gqa, L, D]`` (16-bit, or fp32) and ``lse [kv_heads,
    gqa, L]`` (fp32): views of any strides, channels contiguous. Runs on the current stream; ``out`` may be a
    part (each row is read before it is written)."""
    import torch

    kv_heads, gqa, tokens, d = out.shape
    vec = d // 32
    if (out.stride(-1) != 1 or any(x % vec for x in out.stride()[:3]) or lse.dtype != torch.float32
            or lse.shape != out.shape[:-1]):
        raise ValueError(f"out: channels contiguous and strides {out.stride()} multiples of {vec}, and an fp32 lse of "
                         f"shape {tuple(out.shape[:-1])}: the merge kernel stores {vec} channels at a time")
    halves = [o.dtype for o, _ in parts if o.dtype != torch.float32]
    # one 16-bit part dtype per compiled kernel: out's where out is 16-bit, else the first 16-bit part's (in the
    # parts' order: a set's order of dtypes varies between processes)
    part_dtype = out.dtype if out.dtype != torch.float32 else (halves[0] if halves else torch.bfloat16)
    for index, (o, part_lse) in enumerate(parts):
        if (o.shape != out.shape or o.dtype not in (torch.float32, part_dtype) or part_lse.dtype != torch.float32
                or part_lse.shape != lse.shape):
            raise ValueError(f"parts[{index}]: need o of out's shape {tuple(out.shape)} in fp32 or {part_dtype} and an "
                             f"fp32 lse of shape {tuple(lse.shape)}, got {o.dtype} {tuple(o.shape)} and "
                             f"{part_lse.dtype} {tuple(part_lse.shape)}")
    for name, t in [("out", out), ("lse", lse)] + [(f"parts[{i}]", x) for i, part in enumerate(parts) for x in part]:
        if t.device != out.device or not t.is_cuda:  # the kernel takes every part's address
            raise ValueError(f"{name}: on {t.device}; the merge kernel needs every tensor on out's CUDA device")
    out_type, part_type = (Float32 if out.dtype == torch.float32 else half_type(out.dtype)), half_type(part_dtype)
    arch = device_arch(out.device)
    compiled = cached_compile(("merge_parts", d, part_type, out_type, arch),
                              lambda: compile_merge_parts(d, part_type, out_type, arch))
    launch(compiled, (part_table(parts, out.device), Int64), len(parts), kv_heads, gqa, tokens, (out, out_type),
           *out.stride()[:3], (lse, Float32), *lse.stride())
