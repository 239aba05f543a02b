"""cProfile of attend_chunk's host side at chunks of argv[1:] tokens (default 1024) over a 100K INT2 kc128 prefix
(one-off; run from the project root: ``python benchmarks/results/profile-attend-chunk-cprofile-2026-12-04.py 16 1024``)."""
import cProfile, pstats, statistics, sys, time, io
import torch
sys.path.insert(0, ".")
from benchmarks.decode import MODELS, event_times, scheme_of
from benchmarks.extend import foscar_prefix

q_heads, kv_heads, d = MODELS["qwen3-8b"]
scheme = scheme_of("int2-kc128")
gen = torch.Generator("cuda").manual_seed(0)
cache, seq = foscar_prefix(scheme, kv_heads, 100000, gen)
for chunk in [int(x) for x in sys.argv[1:]] or [1024]:
    q = torch.randn(1, chunk, q_heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_new = torch.randn(1, kv_heads, chunk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_new = torch.randn_like(k_new)
    fo = lambda: cache.attend_chunk(0, [seq], q, k_new, v_new)
    for _ in range(4):
        fo()
    torch.cuda.synchronize()
    ev = statistics.median(event_times(fo, 7))
    hr = []
    for _ in range(7):
        torch.cuda.synchronize(); t = time.perf_counter(); fo(); hr.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    print(f"chunk {chunk}: event {ev:.0f} us, host return {statistics.median(hr):.0f} us", flush=True)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(10):
        fo()
    pr.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(key).print_stats(30); print(s.getvalue()[:9000])
