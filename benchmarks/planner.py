"""Step-plan memory and time at Llama-3.1-8B shapes, on the CPU, with no model and no GPU.

Every step with a compressed request in the batch builds a plan: the compressed rows' head-as-sequence plan
(:func:`rcstat_vllm.attention.head_plan.make_head_plan`) and the other rows' sub-batch for vLLM's own kernels
(:func:`rcstat_vllm.attention.head_plan.plain_rows`). This benchmark builds both for a decode step of
``requests`` running requests of ``tokens`` tokens each, every other one compressed (the first one always), at
Llama-3.1-8B's shapes (32 layers, 8 KV heads, block 16), and prints one JSON line per shape:

    {"requests": 256, "tokens": 131072, "peak_bytes": ..., "ms_per_step": ..., ...}

- ``peak_bytes``: the process's peak resident memory while planning, above what it held before (Linux
  ``/proc/self/status`` VmHWM, reset through ``/proc/self/clear_refs``; glibc told to map and unmap every
  allocation of 64 KiB or more, so freed memory is not reused unseen): what the step's temporaries cost.
- ``ms_per_step``: median wall time of planning one step (the resident tables already committed: a steady decode
  step), in another fresh process with glibc's allocator as it is (mapping and unmapping every temporary, as the
  memory measurement needs, would be timed too).
- ``resident_bytes``: the compressed requests' page tables kept between steps (not part of the peak).

The compressed requests' page tables are synthetic (per head a random kept count between 10% and 100% of the
prompt, pages drawn at random): the plan depends on their shapes, not on which pages they name.

    python benchmarks/planner.py                 # all 9 shapes, results under benchmarks/results/
    python benchmarks/planner.py --requests 256 --tokens 131072
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.peak_memory import peak_extra_bytes, run_in_fresh_process

LAYERS, KV_HEADS, BLOCK = 32, 8, 16
REQUESTS = (1, 64, 256)
TOKENS = (4096, 32768, 131072)
RESULTS = Path(__file__).parent / "results"


@dataclass
class SyntheticCompressed:
    """What the planner reads of a compressed request (:class:`rcstat_vllm.paging.head_pages.CompactedRequest`): kept
    counts ``[L, H]``, the compacted prompt length, and its page table (a slot of the resident tables)."""

    kept: torch.Tensor
    num_compacted_tokens: int
    table: object = None


def build_step(num_requests: int, num_tokens: int, seed: int = 0):
    """A decode step's inputs: query offsets, lengths after the step, vLLM's block table and slot mapping, the
    compressed rows (attached to one HeadPageTables) and the per-layer page space."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from rcstat_vllm.paging.page_space import PageSpace
    from rcstat_vllm.paging.page_tables import HeadPageTables

    generator = torch.Generator().manual_seed(seed)
    seq_len = num_tokens + 1  # the prompt and this step's token
    blocks_per_request = -(-seq_len // BLOCK)
    block_table = torch.arange(num_requests * blocks_per_request, dtype=torch.int32).view(num_requests, -1)
    slot_mapping = block_table[:, -1].to(torch.int64) * BLOCK + (seq_len - 1) % BLOCK
    query_start = list(range(num_requests + 1))
    seq_lens = [seq_len] * num_requests
    tables = HeadPageTables(LAYERS, KV_HEADS, "cpu")
    compressed = {}
    num_pages = num_requests * blocks_per_request * KV_HEADS
    for row in range(0, num_requests, 2):
        kept = (torch.rand(LAYERS, KV_HEADS, generator=generator) * 0.9 + 0.1).mul(num_tokens).long()
        width = -(-(int(kept.max()) + 1) // BLOCK)
        page_ids = torch.randint(0, num_pages, (LAYERS, KV_HEADS, width), generator=generator)
        columns = torch.arange(width).view(1, 1, -1)
        page_ids = torch.where(columns < (kept + 1 + BLOCK - 1).unsqueeze(-1) // BLOCK, page_ids, -1)
        state = SyntheticCompressed(kept, num_tokens)
        state.table = tables.attach(page_ids, kept - num_tokens)
        compressed[row] = state
    space = PageSpace.per_layer(LAYERS, KV_HEADS, BLOCK)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor(query_start, dtype=torch.int32),
        query_start_loc_cpu=torch.tensor(query_start, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=num_requests,
        num_actual_tokens=num_requests,
        max_query_len=1,
        max_seq_len=seq_len,
        block_table_tensor=block_table,
        slot_mapping=slot_mapping,
    )
    return query_start, seq_lens, common, compressed, space, tables


def resident_bytes(tables) -> int:
    return sum(t.host.numel() * t.host.element_size() for t in (tables.pages, tables.length_base))


def plan_once(step):
    """What ``WorkerCompression.plan_step`` builds for a batch holding compressed rows."""
    from rcstat_vllm.attention.head_plan import make_head_plan, plain_rows

    query_start, seq_lens, common, compressed, space, _ = step
    head_plan = make_head_plan(query_start, seq_lens, compressed, space, torch.device("cpu"))
    return head_plan, plain_rows(common, compressed, query_start, seq_lens, BLOCK)


def measure(num_requests: int, num_tokens: int, repeats: int, what: str) -> dict:
    """One shape, in this process: the peak extra resident memory of one plan (``what="memory"``: run under
    :data:`MEASURING_ENV`) or the median time of ``repeats`` plans (``"time"``: glibc as it is, since mapping and
    unmapping every large temporary would be timed too)."""
    torch.set_num_threads(1)
    step = build_step(num_requests, num_tokens)
    step[-1].commit()  # the compaction's one copy happened in an earlier step
    plan_once(step)  # imports and first-call allocations are not the step's
    row = {"requests": num_requests, "tokens": num_tokens, "compressed_requests": len(step[3])}
    if what == "memory":
        row["peak_bytes"], _ = peak_extra_bytes(lambda: plan_once(step))
        row["resident_bytes"] = resident_bytes(step[-1])
        return row
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_once(step)
        times.append((time.perf_counter() - start) * 1e3)
        del plan
    row["ms_per_step"] = round(statistics.median(times), 3)
    return row


def measure_in_fresh_process(num_requests: int, num_tokens: int, repeats: int, what: str) -> dict:
    args = ["--one", what, "--requests", str(num_requests), "--tokens", str(num_tokens), "--repeats", str(repeats)]
    try:
        return run_in_fresh_process(__file__, args, measuring=what == "memory")
    except RuntimeError as error:
        return {"error": str(error).strip().splitlines()[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, nargs="*", default=list(REQUESTS))
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--one", choices=["memory", "time"], help="measure one shape in this process (used internally)")
    parser.add_argument("--out", type=Path, default=RESULTS / "planner_cpu.json")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.requests[0], args.tokens[0], args.repeats, args.one)))
        return
    from benchmarks import result_files
    from benchmarks.common import environment, load_avg

    rows = []
    for num_requests in args.requests:
        for num_tokens in args.tokens:
            row = {"requests": num_requests, "tokens": num_tokens}
            for what in ("memory", "time"):  # each in a fresh process, so one shape's allocations hide no other's
                row.update(measure_in_fresh_process(num_requests, num_tokens, args.repeats, what))
            row.update(layers=LAYERS, kv_heads=KV_HEADS, block_size=BLOCK)
            print(json.dumps(row), flush=True)
            rows.append(row)
    written = result_files.write({"environment": environment(load_avg=load_avg()), "shapes": rows}, args.out)
    print(f"wrote {written}", file=sys.stderr)


if __name__ == "__main__":
    main()
