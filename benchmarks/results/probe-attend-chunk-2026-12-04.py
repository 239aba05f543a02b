"""One-off: where attend_chunk's time goes at chunk 1024 / 128 over a 100K INT2 kc128 prefix (host vs GPU)."""
import functools, statistics, sys, time
import torch
from benchmarks.decode import MODELS, event_times, import_flashinfer, scheme_of
from benchmarks.extend import foscar_prefix, flashinfer_paged

def timeline(fn):
    from torch.profiler import profile, ProfilerActivity
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        t_ret = time.perf_counter()
        torch.cuda.synchronize()
        t_sync = time.perf_counter()
    evs = prof.events()
    cpu = [e for e in evs if e.device_type.name == "CPU"]
    ker = [e for e in evs if e.device_type.name == "CUDA"]
    start = min(e.time_range.start for e in cpu)
    ks = sorted((e.time_range.start - start, e.time_range.end - start, e.name) for e in ker)
    busy, end = 0.0, -1e9
    for s, e, _ in ks:
        if e > end:
            busy += e - max(s, end); end = e
    by = {}
    for s, e, n in ks:
        key = n[:60]
        by[key] = by.get(key, 0) + (e - s)
    top = sorted(by.items(), key=lambda kv: -kv[1])[:8]
    return dict(host_return_us=(t_ret - t0) * 1e6, wall_us=(t_sync - t0) * 1e6, first_kernel_us=ks[0][0],
                last_kernel_end_us=ks[-1][1], kernel_sum_us=sum(e - s for s, e, _ in ks), busy_us=busy,
                kernels=len(ks), top=top,
                gaps=[(round(ks[i][0]), round(ks[i][0] - max(x[1] for x in ks[:i])), ks[i][2][:40]) for i in range(1, len(ks))
                      if ks[i][0] - max(x[1] for x in ks[:i]) > 20])

def main():
    fi = import_flashinfer()
    q_heads, kv_heads, d = MODELS["qwen3-8b"]
    scheme = scheme_of("int2-kc128")
    gen = torch.Generator("cuda").manual_seed(0)
    prefix = 100000
    cache, seq = foscar_prefix(scheme, kv_heads, prefix, gen)
    ws = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    for chunk in [int(c) for c in sys.argv[1].split(",")]:
        q = torch.randn(chunk, q_heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k_all = torch.randn(kv_heads, prefix + chunk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v_all = torch.randn_like(k_all)
        k_new, v_new = k_all[:, prefix:].contiguous(), v_all[:, prefix:].contiguous()
        bf16 = functools.partial(flashinfer_paged(fi, ws, k_all, v_all, chunk, q_heads), q)
        del k_all, v_all
        fo = lambda: cache.attend_chunk(0, [seq], q[None], k_new[None], v_new[None])
        for f in (bf16, fo, bf16, fo, fo):
            f()
        torch.cuda.synchronize()
        for rnd in range(2):
            b = statistics.median(event_times(bf16, 7)); f = statistics.median(event_times(fo, 7))
            hr = []
            for _ in range(5):
                torch.cuda.synchronize(); t = time.perf_counter(); fo(); hr.append((time.perf_counter() - t) * 1e6)
                torch.cuda.synchronize()
            print(f"chunk {chunk} round {rnd}: flashinfer-bf16 {b:.0f} us, attend_chunk {f:.0f} us ({f / b:.2f}x), host return {statistics.median(hr):.0f} us", flush=True)
        t = timeline(fo)
        print(f"chunk {chunk} timeline:", {k: (round(v) if isinstance(v, float) else v) for k, v in t.items() if k not in ("top", "gaps")}, flush=True)
        for name, us in t["top"]:
            print(f"   {us:8.0f} us  {name}")
        print("   gaps >20us (start, gap, kernel):", t["gaps"][:20])

main()
