"""The main job: ``python -m foscar [--bits 2] [--k channel] [--quick]``.

For one variant (default: INT2, KIVI-style K channel-wise + V token-wise, groups of min(128, head_dim),
Qwen3-8B attention geometry): JIT-compile what exists for sm_90a and sm_100a and report each kernel's
registers, local memory (spills) and instruction mix, with the decode main loop's ALU instructions
per KV element and the loop of each warp role. On a Hopper GPU also run the decode kernel, verify
it against the float64 reference (fresh random inputs, poisoned outputs) and time it with
CUDA-graph replays. Exits 1 if a kernel does not build or the check fails, 2 for a bad option.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from .archs import ARCHS as REGISTERED
from .formats import int_widths
from .scheme import Scheme

ARCHS = tuple(REGISTERED)  # the arch registry's targets (foscar.archs)


def compile_report(scheme: Scheme, page_size: int, archs=ARCHS) -> int:
    """Compile every kernel of ``scheme`` for ``archs``; print one line per kernel (and one per
    warp role's loop for the decode kernels). Returns the number of kernels that did not build."""
    from .compile_cache import cache_dir, enabled
    from .decode import compile_decode
    from .inspect import Artifacts, artifacts, decode_loop_stats
    from .jit import cached_compile, half_type
    from .kernels.combine import cached_combine
    from .kernels.dequantize import DequantizeConfig, compile_dequantize
    from .kernels.sink_window import compile_sink_window

    d = scheme.head_dim
    q_type = half_type(scheme.q_dtype)

    # the run paths' cache keys (foscar/kernels/*.py), so the main job and later runs share entries
    def dequantize_k(arch):
        cfg = DequantizeConfig.of(scheme, "k", layout=REGISTERED[arch].layout)  # the arch's cache's bit order
        return cached_compile(("dequantize", cfg, arch), lambda: compile_dequantize(cfg, arch=arch))

    def sink_window(arch):
        gqa = scheme.gqa_ratio
        return cached_compile(("sink_window", d, gqa, q_type, arch), lambda: compile_sink_window(d, gqa, arch, q_type))

    builds = [
        ("sm_90a", "decode (hopper)", lambda: compile_decode(scheme, "sm_90a", page_size)),
        ("sm_90a", "dequantize K", lambda: dequantize_k("sm_90a")),
        ("sm_90a", "combine", lambda: cached_combine(d, q_type, "sm_90a")),
        ("sm_90a", "decode (cache)", lambda: REGISTERED["sm_90a"].compile_cache_decode(scheme, page_size)),
        ("sm_100a", "decode (blackwell)", lambda: compile_decode(scheme, "sm_100a", page_size)),
        ("sm_100a", "dequantize K", lambda: dequantize_k("sm_100a")),
        ("sm_100a", "combine", lambda: cached_combine(d, q_type, "sm_100a")),
        ("sm_100a", "decode (cache)", lambda: REGISTERED["sm_100a"].compile_cache_decode(scheme, page_size)),
        ("sm_100a", "sink + window", lambda: sink_window("sm_100a")),
    ]
    builds = [b for b in builds if b[0] in archs]
    where = f"compile cache {cache_dir()}" if enabled() else "compile cache off (FOSCAR_CACHE=0)"
    print(f"variant {scheme.name}, page size {page_size}: {len(builds)} kernels for {', '.join(archs)} "
          f"(a first compile takes seconds per kernel; {where})")
    print("regs: registers per thread. local: per-thread stack frame in bytes (register spills and local arrays);\n"
          "the main loop is the loop holding the MMAs (else the largest); LDL/STL are its local-memory accesses per "
          "trip.")
    print(f"{'arch':8} {'kernel':18} {'regs':>4} {'local':>5}  instruction mix (main loop; whole kernel)", flush=True)
    failed = 0
    for arch, name, build in builds:
        try:
            built = build()
            art = built if isinstance(built, Artifacts) else artifacts(built)
        except Exception as exc:  # report every kernel, even when one does not build
            print(f"{arch:8} {name:18} not built: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            failed += 1
            continue
        res = art.resources()
        try:
            loop = art.loop_mix(full_opcodes=True)
            whole = art.mix()
        except Exception as exc:  # nvdisasm missing: still report what the cubin says
            print(f"{arch:8} {name:18} {res.registers:4d} {res.local_bytes:5d}  (no SASS: {exc})", flush=True)
            continue
        top = ", ".join(f"{op} {n}" for op, n in whole.most_common(6))
        mma = sum(n for op, n in loop.items() if "MMA" in op)
        local = sum(n for op, n in loop.items() if op.startswith(("LDL", "STL")))
        print(f"{arch:8} {name:18} {res.registers:4d} {res.local_bytes:5d}  loop {sum(loop.values())} instr"
              f" ({mma} MMA, {local} LDL/STL); kernel: {top}", flush=True)
        if name.startswith("decode"):
            for role in art.loops():
                ops = ", ".join(f"{op} {n}" for op, n in role.top)
                print(f"{'':8} {'':18} {'':4} {'':5}    {role.role} loop @{role.start:#x}: {role.instructions} instr, "
                      f"{role.mma} MMA, {role.local_accesses} LDL/STL ({ops})")
        if name == "decode (hopper)":
            stats = decode_loop_stats(loop, scheme.head_dim)
            print(f"{'':8} {'':18} {'':4} {'':5}  main loop per KV element: {stats['shift_logic_per_element']:.2f} shift/logic "
                  f"(LOP3/SHF/PRMT/IMAD.SHL), {stats['instructions_per_element']:.2f} instructions in all", flush=True)
    if failed:
        print(f"{failed} of {len(builds)} kernels did not build")
    return failed


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m foscar", description=__doc__.split("\n\n")[1])
    widths = int_widths()  # of the registered int<bits> formats (foscar.formats)
    parser.add_argument("--bits", type=int, default=2, choices=widths, help="code width of K and V (default: 2)")
    parser.add_argument("--k-bits", type=int, default=None, choices=widths, help="code width of K (default: --bits)")
    parser.add_argument("--v-bits", type=int, default=None, choices=widths, help="code width of V (default: --bits)")
    parser.add_argument("--k", default="channel", choices=("token", "channel"),
                        help="K group axis: token = one token x G channels, channel = one channel x G tokens "
                             "(default: channel, KIVI-style)")
    parser.add_argument("--v", default="token", choices=("token", "channel"), help="V group axis (default: token)")
    parser.add_argument("--group", type=int, default=None,
                        help="group size G of K and V: 32, 64, 128 or head_dim (default: 128, or head_dim if smaller)")
    parser.add_argument("--k-group", type=int, default=None, help="K group size (default: --group)")
    parser.add_argument("--v-group", type=int, default=None, help="V group size (default: --group)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dimension: 64, 128 or 256 (default: 128)")
    parser.add_argument("--gqa", type=int, default=4, help="query heads per KV head (default: 4)")
    parser.add_argument("--page-size", type=int, default=128, help="tokens per cache page (default: 128)")
    parser.add_argument("--arch", default="all", choices=("all",) + ARCHS,
                        help="compile the kernels of one arch, or of both (default: all)")
    parser.add_argument("--quick", action="store_true", help="on a Hopper GPU: verify only, no timing")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    from .quantize import check_page_size

    group = min(128, args.head_dim) if args.group is None else args.group
    k_group = group if args.k_group is None else args.k_group
    v_group = group if args.v_group is None else args.v_group
    try:
        scheme = Scheme.make(args.bits, args.k, k_group, args.v, v_group, args.head_dim, args.gqa,
                             k_bits=args.k_bits, v_bits=args.v_bits)
        check_page_size(scheme, args.page_size)
    except (TypeError, ValueError) as exc:  # a bad option: one line, not a traceback
        parser.error(str(exc))
    archs = ARCHS if args.arch == "all" else (args.arch,)
    failed = compile_report(scheme, args.page_size, archs)
    if failed:
        return 1
    if "sm_90a" in archs and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        return 0 if gpu_check(scheme, args.page_size, args.quick) else 1
    print("no Hopper GPU here (or --arch sm_100a): compiled and inspected only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
