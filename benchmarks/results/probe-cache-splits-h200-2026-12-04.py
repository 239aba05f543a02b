"""One-off: the cache decode (PagedKVCache.attend, sink 64 + window 256) of two packages side by side, interleaved
rounds, CUDA-graph replays (benchmarks.decode.time_layers).

    python benchmarks/results/probe-cache-splits-h200-2026-12-04.py <revA>,<revB> [model:batch:context:bits,...]

(rows default to the few-KV-head batch-1 ones; K token-wise groups of 128)."""
import importlib, statistics, sys, tempfile
from pathlib import Path
import torch
from benchmarks.ab import load
from benchmarks.decode import MODELS, copies_for, time_layers


def layers(pkg, scheme, batch, context, kv_heads, sink=64, window=256, page_size=128):
    cache_mod = importlib.import_module(pkg.__name__ + ".cache")
    granule = importlib.import_module(pkg.__name__ + ".kernels.quantize").granule_of(scheme)
    quantized = granule * max(0, (context - sink - window) // granule)
    d = scheme.head_dim
    nbytes = int(kv_heads * d * batch * (2 * quantized * scheme.bytes_per_element() + 4 * (context - quantized)))
    copies = copies_for(nbytes)
    pages = batch * -(-quantized // page_size)
    cache = cache_mod.PagedKVCache(scheme, num_layers=copies, kv_heads=kv_heads, num_pages=max(1, pages),
                                   max_seqs=batch, max_seq_len=context, page_size=page_size, sink=sink, window=window)
    seqs = [cache.allocate() for _ in range(batch)]
    gen = torch.Generator("cuda").manual_seed(1)
    group = max(1, 2**30 // (kv_heads * context * d))  # sequences per append (below 2^31 elements per tensor)
    for layer in range(copies):
        for first in range(0, batch, group):
            k = torch.randn(min(group, batch - first), kv_heads, context, d, device="cuda", generator=gen,
                            dtype=scheme.q_dtype)
            cache.append(layer, seqs[first:first + group], k, torch.randn_like(k))
    q = torch.randn(batch, kv_heads * scheme.gqa_ratio, d, device="cuda", generator=gen, dtype=scheme.q_dtype)
    return [(lambda layer=layer: cache.attend(layer, seqs, q)) for layer in range(copies)]


def main():
    revs = sys.argv[1].split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pkgs = load(revs, Path(tmp))
        shapes = [("tp8-70b", 1, 131072, 2), ("tp4-70b", 1, 131072, 2), ("tp8-70b", 1, 131072, 4)]
        if len(sys.argv) > 2:
            shapes = [(m, int(b), int(c), int(bits)) for m, b, c, bits in (x.split(":") for x in sys.argv[2].split(","))]
        for model, batch, context, bits in shapes:
            q_heads, kv_heads, d = MODELS[model]
            fns = {}
            for pkg in pkgs:
                scheme = pkg.Scheme.make(bits, "token", 128, "token", 128, d, q_heads // kv_heads)
                fns[pkg.__name__] = layers(pkg, scheme, batch, context, kv_heads)
            times = {n: [] for n in fns}
            for _ in range(3):
                for n, f in fns.items():
                    times[n].append(time_layers(f, reps=15))
            row = [model, f"{batch}x{context}", f"int{bits}-kt128+sw"] + [statistics.median(times[p.__name__]) for p in pkgs]
            print(row, flush=True)
            rows.append(row)
            del fns
            torch.cuda.empty_cache()
    print("| model | shape | method | " + " | ".join(f"{r} (us)" for r in revs) + " |")
    print("|---|---|---|" + "---|" * len(revs))
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | " + " | ".join(f"{x:.1f} ({x / r[3]:.3f})" for x in r[3:]) + " |")


main()
