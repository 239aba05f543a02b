"""End-to-end decode throughput and KV memory: transformers generate with the BF16 cache vs FOSCAR.

    python -m benchmarks.generate [--quick] [--model PATH] [--out benchmarks/results]

A Llama-style model (built from a config with random weights, or loaded from a local ``--model``
path) prefills a long-context batch with SDPA, then decodes ``--steps`` tokens one at a time.
Timed: the decode steps only (CUDA-synchronized wall clock, after one warm-up step), as tokens/s
over the batch. Memory: the bytes the cache holds for the batch (BF16: DynamicCache tensors;
FOSCAR: the pages in use plus the BF16 sink + window slots, all layers). Methods: ``bf16``
(DynamicCache + SDPA), ``foscar-int4`` and ``foscar-int2`` (OSCAR-style token-wise K/V, sink 64,
window 256; INT2 with Hadamard rotation). Results: JSON + markdown with device, versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

GEOMETRY = dict(num_hidden_layers=8, hidden_size=4096, intermediate_size=4096, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=32000)  # Qwen3-8B attention, slim MLP
STANDARD = [(8, 32768), (32, 8192)]
QUICK = [(8, 16384)]


def build_model(path):
    import transformers

    from foscar.integrations.transformers import use_foscar

    if path:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    else:
        config = transformers.LlamaConfig(max_position_embeddings=131072, **GEOMETRY)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    return use_foscar(model.cuda().eval())


def dynamic_cache_bytes(cache):
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@torch.no_grad()
def run(model, method, batch, context, steps):
    import transformers

    from foscar.integrations.transformers import FoscarCache, cache_kwargs

    ids = torch.randint(0, model.config.vocab_size, (batch, context), device="cuda")
    if method == "bf16":
        cache = transformers.DynamicCache(config=model.config)
    else:
        bits = 4 if method == "foscar-int4" else 2
        cache = FoscarCache(model, bits=bits, k="token", max_batch_size=batch, max_seq_len=context + steps + 1,
                            rotate=bits == 2)  # OSCAR's layout, as the results so far (FoscarCache's default: KIVI)
    logits = model(input_ids=ids, **cache_kwargs(cache), logits_to_keep=1).logits[:, -1:]
    token = logits.argmax(-1)
    token = model(input_ids=token, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)  # warm-up step
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        token = model(input_ids=token, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    kv = dynamic_cache_bytes(cache) if method == "bf16" else cache.kv_bytes()
    del cache
    torch.cuda.empty_cache()
    return {"method": method, "batch": batch, "context": context, "steps": steps,
            "ms_per_step": 1e3 * seconds / steps, "tokens_per_s": batch * steps / seconds, "kv_bytes": kv}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default=None, help="local model path (default: random weights from a config)")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():  # before loading anything: the model and caches live on the GPU
        sys.exit("benchmarks.generate needs a CUDA GPU")
    import transformers

    import cutlass

    model = build_model(args.model)
    rows = []
    for batch, context in QUICK if args.quick else STANDARD:
        for method in ("bf16", "foscar-int4", "foscar-int2"):
            row = run(model, method, batch, context, args.steps)
            rows.append(row)
            print(f"{method:12s} batch {batch:3d} context {context:6d}: {row['tokens_per_s']:9.1f} tok/s "
                  f"{row['ms_per_step']:8.2f} ms/step  KV {row['kv_bytes'] / 2**30:7.3f} GiB", flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "cutlass_dsl": getattr(cutlass, "__version__", "?"),
            "python": platform.python_version(), "model": args.model or {"random_weights": GEOMETRY},
            "timing": "decode steps only, CUDA-synchronized wall clock, after one warm-up step"}
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"generate-{datetime.date.today().isoformat()}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    base = {(r["batch"], r["context"]): r for r in rows if r["method"] == "bf16"}
    lines = [f"# generate: decode tokens/s and KV memory ({meta['device']}, {meta['date']})", "",
             f"torch {meta['torch']}, CUDA {meta['cuda']}, transformers {meta['transformers']}, "
             f"nvidia-cutlass-dsl {meta['cutlass_dsl']}; model: {meta['model']}; {meta['timing']}.", "",
             "| method | batch | context | tokens/s | ms/step | speedup | KV GiB | KV vs BF16 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = base[(r["batch"], r["context"])]
        lines.append(f"| {r['method']} | {r['batch']} | {r['context']} | {r['tokens_per_s']:.1f} | {r['ms_per_step']:.2f} | "
                     f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x | {r['kv_bytes'] / 2**30:.3f} | "
                     f"{r['kv_bytes'] / b['kv_bytes']:.3f} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
