"""attend_chunk before / after in one process: bitwise-equal outputs, host time until return and event time.

Usage (from the repository root): python benchmarks/results/chunk-ab-h100-2026-12-05.py BASE_FOSCAR_DIR, the base
tree's foscar package (``git archive <rev> foscar``); the new tree is the installed foscar."""
import importlib, statistics, sys, tempfile, time
from pathlib import Path
import torch
from benchmarks.ab import materialize
from benchmarks.decode import MODELS

into = Path(tempfile.mkdtemp()); sys.path.insert(0, str(into))
pkgs = {"base": importlib.import_module(materialize(sys.argv[1], into)), "new": importlib.import_module("foscar")}
qh, kvh, d = MODELS["qwen3-8b"]
PREFIX = 100_000

def build(pkg, batch):
    s = pkg.Scheme.make(2, "channel", 128, "token", 128, d, qh // kvh)
    cache = importlib.import_module(pkg.__name__ + ".cache").PagedKVCache(s, 1, kvh, num_pages=batch * (-(-PREFIX // 128) + 2), max_seqs=batch,
                                   max_seq_len=PREFIX + 9000, sink=64, window=256)
    g = torch.Generator("cuda").manual_seed(1)
    seqs = [cache.allocate() for _ in range(batch)]
    for start in range(0, PREFIX, 8192):
        n = min(8192, PREFIX - start)
        k = torch.randn(batch, kvh, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
        cache.append(0, seqs, k, torch.randn(k.shape, device="cuda", dtype=k.dtype, generator=g))
    return cache, seqs

def host_event(fn, reps):
    hs, es = [], []
    for _ in range(reps):
        torch.cuda.synchronize(); a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter(); a.record(); fn(); h = time.perf_counter() - t; b.record(); b.synchronize()
        hs.append(h * 1e6); es.append(a.elapsed_time(b) * 1e3)
    return statistics.median(hs), statistics.median(es)

rows = []
for batch in (1, 2):
    caches = {name: build(pkg, batch) for name, pkg in pkgs.items()}
    for chunk in ((16, 13, 128, 1024) if batch == 1 else (16, 128)):
        g = torch.Generator("cuda").manual_seed(chunk)
        q = torch.randn(batch, chunk, qh, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(batch, kvh, chunk, d, device="cuda", dtype=torch.bfloat16, generator=g); v = torch.randn_like(k)
        fns = {n: (lambda c=c, s=s: c.attend_chunk(0, s, q, k, v, return_lse=True)) for n, (c, s) in caches.items()}
        outs = {n: f() for n, f in fns.items()}
        same = all(torch.equal(a, b) for a, b in zip(outs["base"], outs["new"]))
        for f in fns.values():
            for _ in range(3): f()
        times = {n: [] for n in fns}
        for _ in range(5):  # rounds interleaved
            for n, f in fns.items():
                times[n].append(host_event(f, 8))
        med = {n: (statistics.median(x[0] for x in t), statistics.median(x[1] for x in t)) for n, t in times.items()}
        rows.append((batch, chunk, same, med["base"], med["new"]))
        print(rows[-1], flush=True)
print("| batch | chunk | bitwise equal | host us base / new | event us base / new |")
print("|---|---|---|---|---|")
for b, c, same, mb, mn in rows:
    print(f"| {b} | {c} | {same} | {mb[0]:.0f} / {mn[0]:.0f} ({mn[0] / mb[0]:.2f}) | {mb[1]:.0f} / {mn[1]:.0f} ({mn[1] / mb[1]:.2f}) |")
