"""The main job: ``python -m foscar [--bits 2] [--k channel] [--quick]``.

For one variant (default: INT2, KIVI-style K channel-wise + V token-wise, groups of 128, Qwen3-8B
attention geometry): JIT-compile what exists for sm_90a and sm_100a and report each kernel's
registers, spills and instruction mix, with the decode main loop's ALU instructions per KV element.
On a Hopper GPU also run the decode kernel, verify it against the float64 reference (fresh random
inputs, poisoned outputs) and time it with CUDA-graph replays.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from .scheme import Scheme

def compile_report(scheme: Scheme, page_size: int):
    """Compile every kernel of ``scheme`` for both arches; print one line per kernel."""
    from .decode import compile_decode
    from .inspect import Artifacts, artifacts, decode_loop_stats
    from .kernels.combine import compile_combine
    from .kernels.dequantize import compile_dequantize
    from .kernels.quantize import granule_of
    from .kernels.window import compile_window_merge

    slots = 64 + 256 + granule_of(scheme)  # PagedKVCache defaults: sink 64, window 256
    builds = [
        ("sm_90a", "decode (hopper)", lambda: compile_decode(scheme, "sm_90a", page_size)),
        ("sm_90a", "dequantize K", lambda: compile_dequantize(scheme, "k", arch="sm_90a")),
        ("sm_90a", "combine", lambda: compile_combine(scheme.head_dim, "sm_90a")),
        ("sm_90a", "window + merge", lambda: compile_window_merge(scheme.head_dim, slots, scheme.gqa_ratio, "sm_90a")),
        ("sm_100a", "decode (blackwell)", lambda: compile_decode(scheme, "sm_100a", page_size)),
        ("sm_100a", "dequantize K", lambda: compile_dequantize(scheme, "k", arch="sm_100a")),
        ("sm_100a", "combine", lambda: compile_combine(scheme.head_dim, "sm_100a")),
    ]
    print(f"variant {scheme.name}, page size {page_size}")
    print(f"{'arch':8} {'kernel':16} {'regs':>4} {'spill':>5}  instruction mix (main loop; whole kernel)")
    loop_alu = None
    for arch, name, build in builds:
        try:
            built = build()
            art = built if isinstance(built, Artifacts) else artifacts(built)
        except Exception as exc:  # report every kernel, even when one does not build
            print(f"{arch:8} {name:16} not built: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        res = art.resources()
        try:
            loop = art.loop_mix(full_opcodes=True)
            whole = art.mix()
        except Exception as exc:  # nvdisasm missing: still report what the cubin says
            print(f"{arch:8} {name:16} {res.registers:4d} {res.local_bytes:5d}  (no SASS: {exc})")
            continue
        top = ", ".join(f"{op} {n}" for op, n in whole.most_common(6))
        mma = sum(n for op, n in loop.items() if "MMA" in op)
        print(f"{arch:8} {name:16} {res.registers:4d} {res.local_bytes:5d}  loop {sum(loop.values())} instr"
              f" ({mma} MMA); kernel: {top}")
        if name == "decode (hopper)":
            stats = decode_loop_stats(loop, scheme.head_dim)
            loop_alu = stats["shift_logic_per_element"]
            print(f"{'':8} {'':16} main loop per KV element: {loop_alu:.2f} shift/logic (LOP3/SHF/PRMT), "
                  f"{stats['instructions_per_element']:.2f} instructions in all")
    return loop_alu


def gpu_check(scheme: Scheme, page_size: int, quick: bool):
    """Verify on a small ragged problem, then time one Qwen3-8B-sized layer call."""
    from .decode import decode_paged, plan_splits
    from .testing import check_output, random_problem

    q, cache = random_problem(scheme, [1, 63, 4097, 777], kv_heads=8, page_size=page_size)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=q.device)
    decode_paged(q, cache.k_codes, cache.k_params, cache.v_codes, cache.v_params, cache.page_table, cache.lengths,
                 scheme, page_size, return_lse=True, out=out, lse=lse)
    acc = check_output(out, lse, q, cache, scheme.head_dim**-0.5)
    print(f"verify: max|out-ref| {acc.err:.2e} (bf16 torch {acc.bf16_err:.2e}, tol {acc.tol:.2e}), "
          f"max|lse-ref| {acc.lse_err:.2e}: {'PASS' if acc.ok else 'FAIL'}")
    if quick:
        return acc.ok
    batch, context = 8, 32768
    q, cache = random_problem(scheme, [context] * batch, kv_heads=8, page_size=page_size, shuffle=False)
    splits = plan_splits(batch, 8, cache.max_tokens, torch.cuda.get_device_properties(0).multi_processor_count)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device=q.device)

    def call():
        decode_paged(q, cache.k_codes, cache.k_params, cache.v_codes, cache.v_params, cache.page_table, cache.lengths,
                     scheme, page_size, return_lse=True, num_splits=splits, check_pages=False, out=out, lse=lse)

    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    times = []
    for _ in range(20):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    us = statistics.median(times)
    nbytes = cache.nbytes()
    print(f"time: batch {batch} x {context} tokens, {splits} splits: {us:.1f} us, {nbytes / us / 1e6:.2f} TB/s "
          f"({nbytes / 1e6:.0f} MB; L2-resident share possible, see benchmarks/ for the controlled sweep)")
    return acc.ok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=int, default=2, choices=(2, 4))
    parser.add_argument("--k", default="channel", choices=("token", "channel"), help="K group axis")
    parser.add_argument("--v", default="token", choices=("token", "channel"), help="V group axis")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--gqa", type=int, default=4)
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="on a GPU: verify only, no timing")
    args = parser.parse_args(argv)
    scheme = Scheme.make(args.bits, args.k, args.group, args.v, args.group, 128, args.gqa)
    compile_report(scheme, args.page_size)
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        return 0 if gpu_check(scheme, args.page_size, args.quick) else 1
    print("no Hopper GPU here: compiled and inspected only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
