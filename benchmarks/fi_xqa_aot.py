"""Prebuild the XQA kernels of the decode benchmark's ``flashinfer-fp8-xqa`` baseline for sm_90a into a bundled
FlashInfer's own AOT directory (``flashinfer/data/aot/<module>/<module>.so``, which FlashInfer loads before it
would JIT-compile), so that the GPU machine does not compile them. No GPU needed: nvcc at $CUDA_HOME.

    FLASHINFER_CUDA_ARCH_LIST=9.0a PYTHONPATH=SITE python -m benchmarks.fi_xqa_aot SITE

``benchmarks/fi_bundle.sh`` runs it with SITE the unpacked bundle (its flashinfer is the one imported).
"""

import os
import pathlib
import shutil
import sys
import time

import torch

from .decode import MODELS, XQA_PAGE


def xqa_variants(models=MODELS):
    """The (head_dim, query heads per KV head) pairs of the sweep's models: one XQA module each."""
    return sorted({(head_dim, q_heads // kv_heads) for q_heads, kv_heads, head_dim in models.values()})


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit("usage: python -m benchmarks.fi_xqa_aot SITE")
    site = pathlib.Path(argv[0]).resolve()
    if os.environ.get("FLASHINFER_CUDA_ARCH_LIST") != "9.0a":  # else FlashInfer asks the (absent) GPU
        sys.exit("benchmarks.fi_xqa_aot: set FLASHINFER_CUDA_ARCH_LIST=9.0a (the H200's target)")
    import flashinfer
    from flashinfer.jit import env as jit_env
    from flashinfer.jit.xqa import gen_xqa_module

    if site not in pathlib.Path(flashinfer.__file__).resolve().parents:
        sys.exit(f"benchmarks.fi_xqa_aot: imported {flashinfer.__file__}, not the flashinfer of {site}")
    for head_dim, group in xqa_variants():
        spec = gen_xqa_module(torch.bfloat16, torch.float8_e4m3fn, XQA_PAGE, head_dim, group, False, torch.bfloat16,
                              1)
        start = time.time()
        spec.build()
        dest = jit_env.FLASHINFER_AOT_DIR / spec.name / f"{spec.name}.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(spec.jit_library_path, dest)
        print(f"{spec.name}: {time.time() - start:.0f} s, {dest.stat().st_size} bytes", flush=True)


if __name__ == "__main__":
    main()
