"""How fast does the Hopper decode kernel's bulk-copy ring deliver tiles when nothing is computed?

    python -m benchmarks.pipeline_probe [--variants int2-kt128,int4-kt128] [--configs 8x32768,32x8192]

Times, in one process on the same caches, the decode kernel and a variant of it whose consumer
warps only wait for each of their tiles' ``full`` barrier, read one word and release the stage
(same producer warps, ring, grid and split plan, CUDA-graph replays over >= 4x L2). The second is
the delivery ceiling of the copy pipeline (benchmarks/NOTES.md section 6); its outputs are not
attention and are not checked. Qwen3-8B geometry (32 q heads, 8 KV heads, head_dim 128), page 128.
"""

from __future__ import annotations

import argparse

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32

from foscar.hopper.kernel import DecodeConfig, HopperDecodeKernel, default_consumers
from foscar.pipeline import stage_and_phase

from .decode import time_layers
from .hopper_sweep import VARIANTS, cache_sets, planned_splits


class PipelineOnly(HopperDecodeKernel):
    """The decode kernel with consumers that only wait, touch and release each of their stages."""

    @cute.jit
    def consume(self, tiled_mma, ring, full, empty, q_ptr, o_ptr, lse_ptr, length, b, h, split, kv_heads,
                num_splits, t_begin, t_end, scale_log2, warp, lane):
        cfg = self.cfg
        n_local = cutlass.max(t_end - t_begin, 0)
        my_tiles = (cutlass.max(n_local - warp, 0) + cfg.NW - 1) // cfg.NW
        touched = Int32(0)
        for step in cutlass.range(0, my_tiles, 1, unroll=1):
            stage, phase = stage_and_phase(warp + cfg.NW * step, cfg.STAGES)
            cute.arch.mbarrier_wait(full + stage, phase)
            touched = touched + cute.make_tensor(ring + stage * cfg.STAGE_WORDS + lane, cute.make_layout((1,)))[0]
            cute.arch.mbarrier_arrive(empty + stage)
        if touched == Int32(0x7FFFFFFF):  # keeps the reads; practically never true
            cute.make_tensor(lse_ptr, cute.make_layout((1,)))[0] = Float32(1.0)


def compile_pipeline_only(scheme, page_size: int = 128, arch: str = "sm_90a"):
    """Compile (no GPU needed) the probe kernel with partial outputs, as ``foscar.hopper.decode``."""
    from foscar.inspect import compile_for
    from foscar.jit import fake_ptr

    cfg = DecodeConfig(scheme, page_size, True, default_consumers(scheme))
    i32 = Int32(1)
    return compile_for(arch, PipelineOnly(cfg), fake_ptr(cfg.q_dtype), fake_ptr(Int32), fake_ptr(cutlass.Float16),
                       fake_ptr(Int32), fake_ptr(cutlass.Float16), fake_ptr(Int32), fake_ptr(Int32), fake_ptr(Float32),
                       fake_ptr(Float32), i32, i32, i32, i32, Float32(1.0), cuda.CUstream(0))


def probe_layers(scheme, batch, context):
    """(decode closures, probe closures, bytes per call, splits) over the same cache clones."""
    from foscar.hopper.decode import run_decode
    from foscar.jit import current_stream, gmem_ptr

    q, sets, nbytes = cache_sets(scheme, batch, context)
    splits = planned_splits(batch, sets[0].k_codes.shape[1], sets[0].max_tokens)
    compiled = compile_pipeline_only(scheme)
    q_type = DecodeConfig.cute_dtype(scheme.q_dtype)
    b, hq, d = q.shape
    o = torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)

    def probe(c):
        compiled(gmem_ptr(q, q_type), gmem_ptr(c.k_codes, Int32), gmem_ptr(c.k_params, cutlass.Float16),
                 gmem_ptr(c.v_codes, Int32), gmem_ptr(c.v_params, cutlass.Float16), gmem_ptr(c.page_table, Int32),
                 gmem_ptr(c.lengths, Int32), gmem_ptr(o, Float32), gmem_ptr(lse, Float32), Int32(b),
                 Int32(c.k_codes.shape[1]), Int32(c.page_table.shape[1]), Int32(splits), Float32(1.0),
                 current_stream(q.device))

    fns = [(lambda c=c: run_decode(q, c.k_codes, c.k_params, c.v_codes, c.v_params, c.page_table, c.lengths,
                                   scheme.head_dim**-0.5, scheme, splits)) for c in sets]
    return fns, [(lambda c=c: probe(c)) for c in sets], nbytes, splits


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="int2-kt128,int4-kt128")
    parser.add_argument("--configs", default="8x32768,32x8192")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    rows = []
    for name in args.variants.split(","):
        for shape in args.configs.split(","):
            batch, context = map(int, shape.split("x"))
            fns, probes, nbytes, splits = probe_layers(VARIANTS[name], batch, context)
            for kind, closures in (("decode", fns), ("pipeline only", probes)):
                us = time_layers(closures, reps=args.reps)
                rows.append((name, shape, splits, kind, us, nbytes / us / 1e6))
            del fns, probes
            torch.cuda.empty_cache()
    print(f"{'variant':12} {'BxL':>9} {'splits':>6} {'kernel':>14} {'us':>8} {'TB/s':>6}")
    for name, shape, splits, kind, us, tbps in rows:
        print(f"{name:12} {shape:>9} {splits:6d} {kind:>14} {us:8.1f} {tbps:6.2f}")


if __name__ == "__main__":
    main()
