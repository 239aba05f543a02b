"""Generate with a local Hugging Face model on a FOSCAR cache, next to the BF16 cache.

    python -m foscar.integrations.demo --model /path/to/Qwen3-8B --bits 2 --prompt "..." [--k token] [--no-rotate]

Prints both continuations, their greedy-token agreement, the KV bytes of each cache and the decode
time. Needs a CUDA GPU (Hopper for the FOSCAR kernels) and transformers.
"""

from __future__ import annotations

import argparse
import time

import torch

from ..formats import int_widths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local model directory (no downloads)")
    parser.add_argument("--prompt", default="The history of the transistor begins")
    parser.add_argument("--bits", type=int, choices=int_widths(), default=4)
    parser.add_argument("--k", choices=("token", "channel"), default="channel",
                        help="K group axis (default: channel, KIVI's; token: OSCAR's)")
    parser.add_argument("--sink", type=int, default=64)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--rotate", action=argparse.BooleanOptionalAction, default=None,
                        help="Hadamard-rotate K and Q (default: for 2-bit keys, as FoscarCache)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)

    import transformers

    from .transformers import FoscarCache, cache_kwargs, use_foscar

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, local_files_only=True)
    model = use_foscar(model.cuda().eval())
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids.cuda()
    max_len = ids.shape[1] + args.max_new_tokens + 1
    caches = {"bf16": transformers.DynamicCache(config=model.config),
              f"foscar-int{args.bits}": FoscarCache(model, bits=args.bits, k=args.k, max_batch_size=1,
                                              max_seq_len=max_len, sink=args.sink, window=args.window,
                                              rotate=args.rotate)}
    outputs = {}
    for name, cache in caches.items():
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache), do_sample=False,
                                 max_new_tokens=args.max_new_tokens)
        torch.cuda.synchronize()
        outputs[name] = out[0, ids.shape[1]:]
        kv = cache.kv_bytes() if hasattr(cache, "kv_bytes") else sum(
            t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        print(f"--- {name}: {time.perf_counter() - start:.2f} s, KV {kv / 2**20:.1f} MiB")
        print(tokenizer.decode(outputs[name], skip_special_tokens=True))
    a, b = outputs.values()
    n = min(len(a), len(b))
    print(f"greedy-token agreement: {(a[:n] == b[:n]).float().mean().item():.3f} over {n} tokens")


if __name__ == "__main__":
    main()
