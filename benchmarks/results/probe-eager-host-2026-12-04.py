"""Eager calls of one foscar tree (argv[1]: a directory holding a ``foscar`` package, or ``worktree``): a one-token
``attend`` and ``attend_chunk`` of 16 / 128 / 1024 / 8192 tokens over a 100K-token INT2 kc128 prefix, Qwen3-8B heads
(32 / 8, head_dim 128). Prints the medians of 15 CUDA-event times and of 15 host-return times (synchronized
before each call). One-off probe, run from the project root (benchmarks/results/probe-eager-host-h200-2026-12-04.md
has the command)."""
import statistics, sys, time
tree = sys.argv[1]
sys.path.insert(0, ".")
if tree != "worktree":
    sys.path.insert(0, tree)
import torch
import foscar
from benchmarks.decode import MODELS, event_times, scheme_of
from benchmarks.extend import foscar_prefix
assert foscar.__file__.startswith(tree if tree != "worktree" else "/"), foscar.__file__
q_heads, kv_heads, d = MODELS["qwen3-8b"]
gen = torch.Generator("cuda").manual_seed(0)
cache, seq = foscar_prefix(scheme_of("int2-kc128"), kv_heads, 100000, gen)
rows = []
def host(fo, n=15):
    t = []
    for _ in range(n):
        torch.cuda.synchronize(); s = time.perf_counter(); fo(); t.append((time.perf_counter() - s) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(t)
for chunk in (1, 16, 128, 1024, 8192):
    q = torch.randn(1, chunk, q_heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    if chunk == 1:
        fo = lambda: cache.attend(0, [seq], q[:, 0])
        name = "attend 1 token"
    else:
        k_new = torch.randn(1, kv_heads, chunk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v_new = torch.randn_like(k_new)
        fo = lambda: cache.attend_chunk(0, [seq], q, k_new, v_new)
        name = f"attend_chunk {chunk}"
    for _ in range(5): fo()
    ev = statistics.median(event_times(fo, 15))
    rows.append((name, ev, host(fo)))
for name, ev, h in rows:
    print(f"{tree:>22s} | {name:18s} | event {ev:8.1f} us | host return {h:8.1f} us")
