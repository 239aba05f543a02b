"""How fast does the Hopper decode kernel's bulk-copy ring deliver tiles when nothing is computed?

    python -m benchmarks.pipeline_probe [--variants int2-kt128,int4-kt128] [--configs 8x32768,32x8192]

Times, in one process on the same caches, the decode kernel and a variant of it whose consumer
warps only wait for each of their tiles' ``full`` barrier, read one word and release the stage
(same producer warps, ring, grid and split plan, CUDA-graph replays over >= 4x L2). The second is
the delivery ceiling of the copy pipeline (benchmarks/NOTES.md section 6); its outputs are not
attention and are not checked. A third row reads the call's bytes as one contiguous buffer with the
Triton read kernel of ``benchmarks.ceiling`` (same replay scheme): the ceiling at this call size,
launch and ramp included. Qwen3-8B geometry (32 q heads, 8 KV heads, head_dim 128), page 128.
"""

from __future__ import annotations

import argparse
import sys

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass.cutlass_dsl import dsl_user_op
from cutlass import Float32, Int32

from cutlass import Int64

from foscar.device import at, cp_async_16, inline_ptx
from foscar.hopper.kernel import PRODUCER_WARPS, DecodeConfig, HopperDecodeKernel, default_consumers
from foscar.query_rows import KvHead, Output
from foscar.layouts.fragment import TILE_TOKENS
from foscar.pipeline import PackedPages, Ring, TileSpan, bulk_copy_g2s
from foscar.pipeline import phase as phase_of
from foscar.pipeline import stage as stage_of

from .decode import copies_for, read_ceiling_us, time_layers
from .hopper_sweep import VARIANTS, cache_sets, planned_splits


@dsl_user_op
def cp_async_arrive(mbar: cute.Pointer, *, loc=None, ip=None):
    """``cp.async.mbarrier.arrive``: raise ``mbar``'s pending count by one now and arrive once when
    this thread's earlier ``cp.async`` copies have landed (the phase waits for both)."""
    inline_ptx(None, [mbar.toint(loc=loc, ip=ip)], "cp.async.mbarrier.arrive.shared.b64 [$0];", "r,~{memory}", True, loc, ip)


COPIES = {
    "tile": "4 copies per 64-token tile: K codes, V codes, K params, V params (the decode kernel's)",
    "page": "4 copies per 128-token page: the same bytes in half as many copies of twice the size",
    "codes": "2 copies per tile: K and V codes only (params not read)",
    "mixed": "K codes + params by bulk copy (TMA), V codes + params by 16-byte cp.async of the producer warp's lanes",
}


class PipelineOnly(HopperDecodeKernel):
    """The decode kernel with consumers that only wait, touch and release each of their stages, and
    a producer that issues the copies of ``copies`` (see COPIES) into the same ring bytes."""

    def __init__(self, cfg: DecodeConfig, copies: str = "tile"):
        super().__init__(cfg)
        if copies not in COPIES:
            raise ValueError(f"copies must be one of {sorted(COPIES)}, got {copies!r}")
        if cfg.K_TW != cfg.V_TW:
            raise ValueError(f"the probe copies K and V tiles of one size: {cfg.scheme.name} mixes bit widths")
        self.copies = copies
        self.unit = cfg.SUB if copies == "page" else 1  # tiles per stage
        self.stages = cfg.STAGES // self.unit  # same ring bytes
        if self.stages % cfg.NW or self.stages == 0:
            raise ValueError(f"{copies}: {self.stages} stages are not a multiple of {cfg.NW} consumer warps")
        self.unit_words = self.unit * cfg.STAGE_WORDS
        params = 0 if copies == "codes" else 4 * (cfg.KPW + cfg.VPW)
        self.unit_bytes = self.unit * (8 * cfg.K_TW + params)

    @cute.jit
    def produce(self, ring: Ring, pages: PackedPages, head: KvHead, tiles: TileSpan, pw, lane):
        cfg = self.cfg
        P, U, SUB = PRODUCER_WARPS, self.unit, cfg.SUB
        u_begin = tiles.begin // U
        u_end = (tiles.end + U - 1) // U
        page_first = tiles.begin // SUB
        page_end = (tiles.end + SUB - 1) // SUB
        full, empty = ring.barriers.full(0), ring.barriers.empty(0)
        for chunk in cutlass.range(page_first, page_end, 32, unroll=1):
            table_row = head.row.to(Int64) * pages.max_pages
            my_page = at(pages.page_table, table_row + cutlass.min(chunk + lane, page_end - 1))  # page table
            u_lo = cutlass.max(u_begin, chunk * SUB // U)
            u_hi = cutlass.min(u_end, (chunk + 32) * SUB // U)
            first = u_lo + (pw + P - (u_lo - u_begin) % P) % P
            for unit in cutlass.range(first, u_hi, P, unroll=1):
                tile = unit * U
                page = cute.arch.shuffle_sync(my_page, offset=tile // SUB - chunk)
                if cutlass.const_expr(self.copies == "mixed"):
                    self.produce_mixed(ring, pages, page.to(Int64) * head.kv_heads + head.h, tile, unit - u_begin,
                                       lane)
                elif lane == 0:
                    s, phase = stage_of(unit - u_begin, self.stages), phase_of(unit - u_begin, self.stages)
                    cute.arch.mbarrier_wait(empty + s, phase ^ 1)
                    cute.arch.mbarrier_arrive_and_expect_tx(full + s, self.unit_bytes)
                    page_head = page.to(Int64) * head.kv_heads + head.h
                    slot0 = (tile % SUB) * TILE_TOKENS
                    dst = ring.words + cute.assume(s * self.unit_words, divby=4)
                    codes = (page_head * SUB + tile % SUB) * cfg.K_TW
                    bulk_copy_g2s(dst, pages.k_codes + codes, 4 * cfg.K_TW * U, full + s)
                    bulk_copy_g2s(dst + U * cfg.K_TW, pages.v_codes + codes, 4 * cfg.K_TW * U, full + s)
                    if cutlass.const_expr(self.copies != "codes"):
                        kp = dst + 2 * U * cfg.K_TW
                        bulk_copy_g2s(kp, pages.k_params + self.params_element(cfg.plan.k, page_head, slot0),
                                      4 * cfg.KPW * U, full + s)
                        bulk_copy_g2s(kp + U * cfg.KPW, pages.v_params + self.params_element(cfg.plan.v, page_head, slot0),
                                      4 * cfg.VPW * U, full + s)

    @cute.jit
    def produce_mixed(self, ring: Ring, pages: PackedPages, page_head, tile, local, lane):
        """One tile of (page, KV head) ``page_head``: every lane waits for the stage, copies its 16-byte pieces
        of V codes and params with cp.async and registers them on ``full`` (pending count +1 each, before
        lane 0's arrive, so the phase cannot complete early); then lane 0 bulk-copies K codes and params."""
        cfg = self.cfg
        full, empty = ring.barriers.full(0), ring.barriers.empty(0)
        s, phase = stage_of(local, self.stages), phase_of(local, self.stages)
        cute.arch.mbarrier_wait(empty + s, phase ^ 1)
        slot0 = (tile % cfg.SUB) * TILE_TOKENS
        dst = ring.words + cute.assume(s * self.unit_words, divby=4)
        codes = (page_head * cfg.SUB + tile % cfg.SUB) * cfg.K_TW
        for x in cutlass.range_constexpr(cfg.K_TW // 4 // 32):  # 16-byte pieces of V codes per lane
            piece = 4 * (32 * x + lane)
            cp_async_16(dst + cfg.K_TW + piece, pages.v_codes + codes + piece)
        vrow = self.params_element(cfg.plan.v, page_head, slot0)
        for x in cutlass.range_constexpr((cfg.VPW // 4 + 31) // 32):
            piece = 4 * (32 * x + lane)
            if piece < cfg.VPW:
                cp_async_16(dst + 2 * cfg.K_TW + cfg.KPW + piece, pages.v_params + vrow + 2 * piece)
        cp_async_arrive(full + s)
        cute.arch.sync_warp()
        if lane == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(full + s, 4 * (cfg.K_TW + cfg.KPW))
            bulk_copy_g2s(dst, pages.k_codes + codes, 4 * cfg.K_TW, full + s)
            bulk_copy_g2s(dst + 2 * cfg.K_TW, pages.k_params + self.params_element(cfg.plan.k, page_head, slot0), 4 * cfg.KPW,
                          full + s)

    @cute.jit
    def consume(self, mma, warp, ring: Ring, q_ptr, head: KvHead, tiles: TileSpan, out: Output, scale_log2):
        cfg = self.cfg
        words, full, empty, lse = ring.words, ring.barriers.full(0), ring.barriers.empty(0), out.lse
        n_local = cutlass.max((tiles.end + self.unit - 1) // self.unit - tiles.begin // self.unit, 0)
        my_units = (cutlass.max(n_local - warp, 0) + cfg.NW - 1) // cfg.NW
        touched = Int32(0)
        for step in cutlass.range(0, my_units, 1, unroll=1):
            stage, phase = stage_of(warp + cfg.NW * step, self.stages), phase_of(warp + cfg.NW * step, self.stages)
            cute.arch.mbarrier_wait(full + stage, phase)
            touched = touched + at(words, stage * self.unit_words + mma.lane)
            cute.arch.mbarrier_arrive(empty + stage)
        if touched == Int32(0x7FFFFFFF):  # keeps the reads; practically never true
            cute.make_tensor(lse, cute.make_layout((1,)))[0] = Float32(1.0)


def compile_pipeline_only(scheme, page_size: int = 128, arch: str = "sm_90a", copies: str = "tile"):
    """Compile (no GPU needed) the probe kernel with partial outputs, as ``foscar.launch`` does the decode kernel."""
    from foscar.inspect import compile_for
    from foscar.jit import fake_ptr

    cfg = DecodeConfig(scheme, page_size, True, default_consumers(scheme))
    i32 = Int32(1)
    return compile_for(arch, PipelineOnly(cfg, copies), fake_ptr(cfg.q_dtype), fake_ptr(Int32), fake_ptr(cutlass.Float16),
                       fake_ptr(Int32), fake_ptr(cutlass.Float16), fake_ptr(Int32), fake_ptr(Int32), fake_ptr(Float32),
                       fake_ptr(Float32), i32, i32, i32, i32, Float32(1.0), cuda.CUstream(0))


def probe_layers(scheme, batch, context, copies=("tile",)):
    """Decode closures, {copies: probe closures}, bytes per call and splits, over the same cache clones."""
    from foscar.hopper.decode import KERNELS
    from foscar.jit import half_type, launch

    q, sets, nbytes = cache_sets(scheme, batch, context)
    splits = planned_splits(batch, sets[0].k_codes.shape[1], sets[0].max_tokens)
    q_type = half_type(scheme.q_dtype)
    b, hq, d = q.shape
    o = torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)

    def probe(compiled, c):
        launch(compiled, (q, q_type), (c.k_codes, Int32), (c.k_params, cutlass.Float16), (c.v_codes, Int32),
               (c.v_params, cutlass.Float16), (c.page_table, Int32), (c.lengths, Int32), (o, Float32), (lse, Float32),
               (b, Int32), (c.k_codes.shape[1], Int32), (c.page_table.shape[1], Int32), (splits, Int32), (1.0, Float32))

    fns = [(lambda c=c: KERNELS.run_decode(q, c.k_codes, c.k_params, c.v_codes, c.v_params, c.page_table,
                                           c.lengths, scheme.head_dim**-0.5, scheme, splits,
                                           consumers=default_consumers(scheme))) for c in sets]  # the probe's
    probes = {}
    for kind in copies:
        compiled = compile_pipeline_only(scheme, copies=kind)
        probes[kind] = [(lambda c=c, k=compiled: probe(k, c)) for c in sets]
    return fns, probes, nbytes, splits


def copied_fraction(scheme, copies: str) -> float:
    """Share of a call's bytes that the ``copies`` probe reads (the codes alone for 'codes')."""
    if copies != "codes":
        return 1.0
    cfg = DecodeConfig(scheme, 128, True, default_consumers(scheme))
    return (cfg.K_TW + cfg.V_TW) / (cfg.K_TW + cfg.V_TW + cfg.KPW + cfg.VPW)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="int2-kt128,int4-kt128")
    parser.add_argument("--configs", default="8x32768,32x8192")
    parser.add_argument("--copies", default="tile", help="comma-separated: " + "; ".join(f"{k}: {v}" for k, v in COPIES.items()))
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks.pipeline_probe needs a CUDA GPU")
    copies = args.copies.split(",")
    rows = []
    for name in args.variants.split(","):
        scheme = VARIANTS[name]
        for shape in args.configs.split(","):
            batch, context = map(int, shape.split("x"))
            fns, probes, nbytes, splits = probe_layers(scheme, batch, context, copies)
            us, _ = read_ceiling_us(nbytes, copies_for(nbytes))
            rows.append((name, shape, splits, "same-bytes read", us, nbytes / us / 1e6))
            us = time_layers(fns, reps=args.reps)
            rows.append((name, shape, splits, "decode", us, nbytes / us / 1e6))
            for kind, closures in probes.items():
                us = time_layers(closures, reps=args.reps)
                rows.append((name, shape, splits, f"copies={kind}", us, nbytes * copied_fraction(scheme, kind) / us / 1e6))
            del fns, probes
            torch.cuda.empty_cache()
    print(f"{'variant':12} {'BxL':>9} {'splits':>6} {'kernel':>14} {'us':>8} {'TB/s':>6}")
    for name, shape, splits, kind, us, tbps in rows:
        print(f"{name:12} {shape:>9} {splits:6d} {kind:>14} {us:8.1f} {tbps:6.2f}")


if __name__ == "__main__":
    main()
