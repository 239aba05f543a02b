"""The raw record of a benchmark run: ``<out>/<tag>.json`` (the run's metadata and its rows) and ``<tag>.md`` (a
heading, the command, versions and the table), what ``benchmarks/results/`` holds."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys

import torch

__all__ = ["run_meta", "write"]


def run_meta(module: str, argv, versions: dict, device: str | None = None, **extra) -> dict:
    """Date (UTC), ``device`` (default: CUDA device 0's name), torch, Python, package ``versions`` and the command of a
    run of ``module``."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device or torch.cuda.get_device_name(0), "torch": torch.__version__,
            "python": platform.python_version(),
            "versions": versions,
            "command": f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:]), **extra}


def write(out: str, tag: str, title: str, meta: dict, rows, table: str, note: str = "") -> str:
    """Write the JSON record and the markdown table of a run; returns the path stem."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, tag)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(f"# {title} ({meta['device']}, {meta['date']})\n\nCommand: `{meta['command']}`. "
                f"{note}Versions: {meta['versions']}, torch {meta['torch']}.\n\n{table}\n")
    return stem
