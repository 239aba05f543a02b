"""Time a few FOSCAR rows, kernel alone and with the BF16 sink + window (``PagedKVCache.attend``), one
line per row: the quick before/after check of a kernel change. Run it from each build's directory in
one device call (``cd <old build> && python -m benchmarks.rows before``; the same in this one with
``after``); ``SW_ONLY=1`` skips the kernel-alone rows. CUDA graphs, median of 10 replays, us per
layer (``benchmarks.decode``'s timing); the full side-by-side sweep is ``benchmarks.decode``."""

import os
import sys

import torch

from foscar import Scheme

from .decode import MODELS, foscar_layers, foscar_window_layers, time_layers

ROWS = [("tp8-70b", 1, 131072), ("tp4-70b", 1, 131072), ("qwen3-8b", 1, 32768), ("qwen3-8b", 1, 131072),
        ("qwen3-8b", 8, 32768), ("qwen3-8b", 32, 8192), ("qwen3-8b", 128, 8192), ("mha-32", 8, 8192)]
VARIANTS = (("int2-kt", 2, "token"), ("int4-kt", 4, "token"), ("int2-kc", 2, "channel"))


def main(label: str):
    if not torch.cuda.is_available():
        sys.exit("benchmarks.rows needs a CUDA GPU")
    for model, batch, context in ROWS:
        q_heads, kv_heads, head_dim = MODELS[model]
        for name, bits, k in VARIANTS:
            if name == "int2-kc" and model != "qwen3-8b":
                continue
            scheme = Scheme.make(bits, k, 128, "token", 128, head_dim, q_heads // kv_heads)
            alone, splits = float("nan"), 0
            if not os.environ.get("SW_ONLY"):
                fns, _, _, splits = foscar_layers(scheme, batch, context, kv_heads)
                alone = time_layers(fns, 10)
                del fns
            window_fns, _, _ = foscar_window_layers(scheme, batch, context, kv_heads)
            with_window = time_layers(window_fns, 10)
            del window_fns
            torch.cuda.empty_cache()
            print(f"{label:8s} {model:9s} {batch:4d} {context:7d} {name} splits={splits:3d} alone={alone:7.1f} "
                  f"sw={with_window:7.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "run")
