"""One-off: benchmarks.decode's rows for the short-context shapes beside FlashInfer BF16, one process."""
import os, sys, torch
from benchmarks import decode as d
shapes = [("qwen3-8b", 256, 2048), ("qwen3-8b", 32, 8192), ("qwen3-8b", 128, 8192)]
methods = ["flashinfer-bf16", "int2-kt128", "int2-kc128", "int4-kt128"]
d.check_flashinfer_paths(methods)
rows = d.run_sweep(shapes, methods, 15)
ceiling_us, ceiling_bytes = d.read_ceiling_us()
ceiling = ceiling_bytes / ceiling_us / 1e6
meta = {"device": torch.cuda.get_device_name(0), "date": "2026-12-04", "torch": torch.__version__, "versions": d._versions(),
        "read_ceiling_tbps": ceiling, "timing": "CUDA graph, median of 15 replays",
        "command": "python .xfer/short_rows.py (one-off: benchmarks.decode.run_sweep over three shapes)"}
table, geo = d.save(rows, meta, ceiling, os.path.join(sys.argv[1], "decode-h200-2026-12-04-short-contexts"))
print(table)
