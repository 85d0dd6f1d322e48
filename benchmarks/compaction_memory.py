"""Peak extra memory of compacting one long prompt, on the CPU, with no model.

:func:`rcstat_vllm.paging.compaction.compact_request` moves every (layer, KV head)'s kept tokens into head pages. It
works one layer at a time, so what it allocates beyond the cache is one layer's kept keys and values plus their indices,
also when the scheduler hands the request its own prompt blocks back as destinations (memory was short) and pooled
pages would let one layer overwrite another's prompt KV still to be moved (see ``compaction_order``).

Each shape runs in a fresh process (:mod:`benchmarks.peak_memory`): a pooled all-layers cache like vLLM's, one
request of ``tokens`` tokens, per-layer kept shares drawn between 0.3 and 0.9 (a model-wide budget's spread; 0.6 on
average), and destinations either fresh blocks or the request's own blocks in another order. It prints one JSON
line per shape:

    {"tokens": 32768, "layers": 30, "destination": "reused", "peak_extra_bytes": ...,
     "largest_layer_kept_kv_bytes": ..., "ratio": ...}

``ratio`` is the peak over the largest layer's kept keys and values (the target: <= 1.2).

    python benchmarks/compaction_memory.py                     # Llama-3.1-8B's KV shape (8 heads x 128, bf16), 32k x 30
    python benchmarks/compaction_memory.py --heads 2 --head-dim 64 --dtype float32   # what the test runs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.peak_memory import peak_extra_bytes, run_in_fresh_process

RESULTS = Path(__file__).parent / "results"
BLOCK = 16


def build(tokens: int, layers: int, heads: int, head_dim: int, dtype: torch.dtype, destination: str, seed: int = 0):
    """A pooled cache holding one request's prompt, its keep masks and the destination blocks the scheduler gives."""
    from rcstat_vllm.paging.compaction import blocks_needed
    from rcstat_vllm.paging.page_space import cdiv, pooled_space_or_reason

    g = torch.Generator().manual_seed(seed)
    prompt_blocks = cdiv(tokens, BLOCK)
    num_blocks = 2 * prompt_blocks + 1  # room for fresh destinations beside the prompt
    backing = torch.empty(layers * num_blocks, heads, BLOCK, 2 * head_dim, dtype=dtype)
    backing.normal_(generator=g)
    caches = list(backing.view(layers, num_blocks, heads, BLOCK, 2 * head_dim).unbind(0))
    space, reason = pooled_space_or_reason(caches, heads, BLOCK)
    assert space is not None, reason
    blocks = torch.randperm(num_blocks - 1, generator=g) + 1
    row, free = blocks[:prompt_blocks], blocks[prompt_blocks:]
    shares = 0.3 + 0.6 * torch.rand(layers, 1, generator=g)
    masks = [torch.rand(heads, tokens, generator=g) < shares[layer] for layer in range(layers)]
    kept = torch.stack([mask.sum(1) for mask in masks])
    keep_blocks = blocks_needed(kept, tokens, space)
    dest = (
        free[:keep_blocks] if destination == "fresh" else row[torch.randperm(prompt_blocks, generator=g)[:keep_blocks]]
    )
    return caches, row, masks, dest, space, kept


def measure(tokens: int, layers: int, heads: int, head_dim: int, dtype: str, destination: str) -> dict:
    from rcstat_vllm.paging.compaction import compact_request

    torch.set_num_threads(1)
    compact_request(
        *build(4 * BLOCK, layers, heads, head_dim, getattr(torch, dtype), destination)[:5]
    )  # first calls' one-off allocations are not compaction's
    caches, row, masks, dest, space, kept = build(tokens, layers, heads, head_dim, getattr(torch, dtype), destination)
    peak, state = peak_extra_bytes(lambda: compact_request(caches, row, masks, dest, space))
    entry_bytes = 2 * head_dim * caches[0].element_size()  # one token's key and value in one head
    largest = int(kept.sum(1).max()) * entry_bytes
    return {
        "tokens": tokens,
        "layers": layers,
        "kv_heads": heads,
        "head_dim": head_dim,
        "dtype": dtype,
        "destination": destination,
        "kept_share": round(float(kept.sum()) / (layers * heads * tokens), 3),
        "blocks_kept": state.keep_blocks,
        "peak_extra_bytes": peak,
        "largest_layer_kept_kv_bytes": largest,
        "all_layers_kept_kv_bytes": int(kept.sum()) * entry_bytes,
        "ratio": round(peak / largest, 3),
    }


def measure_in_fresh_process(**shape) -> dict:
    """:func:`measure` in its own process started with :data:`MEASURING_ENV` (the only way the peak is honest)."""
    return run_in_fresh_process(__file__, ["--one"] + [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--destination", nargs="*", default=["fresh", "reused"], choices=["fresh", "reused"])
    parser.add_argument("--one", action="store_true", help="measure one shape in this process (used internally)")
    parser.add_argument("--out", type=Path, default=RESULTS / "compaction_memory_cpu.json")
    args = parser.parse_args()
    shape = dict(tokens=args.tokens, layers=args.layers, heads=args.heads, head_dim=args.head_dim, dtype=args.dtype)
    if args.one:
        print(json.dumps(measure(**shape, destination=args.destination[0])))
        return
    from benchmarks import result_files
    from benchmarks.common import environment, load_avg

    rows = []
    for destination in args.destination:
        rows.append(measure_in_fresh_process(**shape, destination=destination))
        print(json.dumps(rows[-1]), flush=True)
    written = result_files.write({"environment": environment(load_avg=load_avg()), "shapes": rows}, args.out)
    print(f"wrote {written}", file=sys.stderr)


if __name__ == "__main__":
    main()
