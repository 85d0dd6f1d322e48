"""What a lazy compaction adds to the step that runs it, on the worker: score, select, copy one request.

Under lazy eviction (the default) a request is scored in the step that compacts it (its scoring deferred since its
prefill: a request that never meets pressure is never scored), so that step's forward waits for: every layer's
scoring from the kept window queries (``RequestCompressor.score_deferred``), the selection over all layers, and the
copy of the kept entries into fresh head pages (``compact_request``). ``serving_cpu.json`` measured about 100 ms per
copy on a 2-core Xeon against vanilla's 82 ms median inter-token gap: its ITL p99 was that step.

Here, in one process and one thread (vLLM-CPU binds an engine to its cores; a served engine here had one), with
SmolLM2-135M's shapes (30 layers, 3 KV heads of 9 query heads, head size 64, block size 32) and the bare flag's
settings, a request of ``n`` prompt tokens is compacted over and over, its parts timed, in interleaved rounds:

  layer_by_layer  scored at the copy, one layer per call (before score-ahead and stacking; the Triton kernels on
                  CUDA also score layer by layer)
  stacked         scored at the copy, the layers stacked into one call per ``DEFERRED_LAYERS_BYTES`` of keys
                  (``Scorer.score_layers``): a plan the relief needs at once (a prompt arriving for more blocks than
                  are free)
  scored_ahead    scored ahead of the copy, a third of the layers per step, then selected in a step of its own
                  (what the worker does for the plans the relief names ``SCORE_AHEAD_STEPS`` steps ahead): the copy
                  step only copies
  scored_ahead_copy_by_layer
                  the same, the copy one layer at a time (before runs of layers were copied together:
                  ``compaction.COPY_GROUP_BYTES`` set to 0)
  scored_ahead_torch_writes
                  the copy's writes by the layout's torch scatter (``CPUAmxLayout``, ``CPUVecLayout``) instead of
                  vLLM's own cache write (``cpu_kv_layout.VllmWrites``, what the engine writes with)

The cache is bf16 in vLLM-CPU's AMX tiles where the CPU has AMX (the layout the engine uses there), else float32
rows (``vec``); ``--layout amx`` takes the AMX tiles on any AVX-512 CPU (the scoring and the copy's reads are plain
torch over them and vLLM's write op stores without AMX instructions; only the attention kernels need AMX).
Medians over rounds; the ratio is taken within each round.

    python benchmarks/compaction_step.py                 # writes benchmarks/results/compaction_step_cpu.json
    python benchmarks/compaction_step.py --sizes 320 --rounds 3 --json /tmp/c.json
    python benchmarks/compaction_step.py --layout amx --json benchmarks/results/compaction_step_copy_runs_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, write_report

import rcstat_vllm.paging.compaction as copying
import rcstat_vllm.worker.prompt_compression as compression
from rcstat_vllm.config import RCStatConfig
from rcstat_vllm.paging.compaction import compact_request
from rcstat_vllm.paging.cpu_kv_layout import CPU_AMX_PACKED, CPU_VEC_WRITTEN
from rcstat_vllm.paging.kv_layout import CPU_AMX, CPU_VEC, amx_unsupported_reason
from rcstat_vllm.paging.page_space import PageSpace, cdiv
from rcstat_vllm.reports import SCORE_AHEAD_STEPS
from rcstat_vllm.worker.prompt_compression import CompressionDecision, RequestCompressor, deferred_keep_blocks

RESULTS = Path(__file__).resolve().parent / "results" / "compaction_step_cpu.json"
LAYERS, KV_HEADS, GROUP, HEAD_DIM, BLOCK = 30, 3, 3, 64, 32
MODES = ("layer_by_layer", "stacked", "scored_ahead", "scored_ahead_copy_by_layer", "scored_ahead_torch_writes")


def machine_layout(choice: str = "auto"):
    """vLLM-CPU's layout on this CPU (``auto``): AMX tiles (bf16) where it has AMX, else float32 rows; or the one
    named (``amx``, ``vec``)."""
    if choice == "auto":
        has_amx = torch.backends.cpu.get_cpu_capability() == "AVX512" and "amx" in Path("/proc/cpuinfo").read_text()
        choice = "amx" if has_amx and amx_unsupported_reason(torch.bfloat16, BLOCK, HEAD_DIM) is None else "vec"
    return (CPU_AMX_PACKED, torch.bfloat16) if choice == "amx" else (CPU_VEC_WRITTEN["vec"], torch.float32)


class Setup:
    """A pooled all-layers cache holding one request's prompt, its window queries, and fresh blocks to copy into."""

    def __init__(self, n: int, layout, dtype, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        prompt_blocks = cdiv(n, BLOCK)
        self.num_blocks = 2 * prompt_blocks + 2
        backing = torch.randn(LAYERS * self.num_blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM, generator=gen).to(dtype)
        self.caches = list(backing.view(LAYERS, self.num_blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM).unbind(0))
        base = [layer * self.num_blocks * KV_HEADS for layer in range(LAYERS)]
        self.space = PageSpace.pooled(backing, base, KV_HEADS, BLOCK)
        self.row = torch.arange(prompt_blocks)
        self.n, self.layout = n, layout
        self.config = RCStatConfig.from_dict({})  # the bare flag: lazy, budget 0.4 over pooled pages
        self.queries = [torch.randn(n, KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
        self.keep_blocks = deferred_keep_blocks(self.config, n, LAYERS, self.space)
        assert self.keep_blocks is not None

    def request(self) -> RequestCompressor:
        """A request as the prefill leaves it under lazy eviction: windows kept, nothing scored, planned."""
        request = RequestCompressor(CompressionDecision("r", self.config, self.n, 0, self.n), LAYERS, self.row)
        request.defer_scoring()
        for layer, queries in enumerate(self.queries):
            request.observe_layer(layer, queries, self.caches[layer], HEAD_DIM**-0.5, self.layout)
        request.keep_blocks = request.plan_deferred(self.space, self.keep_blocks)
        return request

    def compaction(self, mode: str) -> dict[str, float]:
        """Milliseconds of each part of one compaction in ``mode`` (:data:`MODES`): what the step that copies waits
        for (``copy_step_ms``: ``RequestCompressor.compact`` for a lazy plan) and, scored ahead, the longest of the
        steps before it (``ahead_step_ms``)."""
        request = self.request()
        saved, saved_copy = compression.DEFERRED_LAYERS_BYTES, copying.COPY_GROUP_BYTES
        compression.DEFERRED_LAYERS_BYTES = 0 if mode == "layer_by_layer" else saved  # 0: one layer per call
        copying.COPY_GROUP_BYTES = 0 if mode == "scored_ahead_copy_by_layer" else saved_copy
        try:
            ahead, select_ahead = [], 0.0
            if mode.startswith("scored_ahead"):  # the steps before the copy: a share of the layers each, then select
                share = cdiv(LAYERS, SCORE_AHEAD_STEPS - 2)
                while not request.scored_deferred:
                    t = time.perf_counter()
                    request.score_deferred(self.caches, self.layout, share)
                    ahead.append(time.perf_counter() - t)
                t = time.perf_counter()
                request.select_deferred(self.caches, self.space, self.layout)
                select_ahead = time.perf_counter() - t
                ahead.append(select_ahead)
            t0 = time.perf_counter()
            if request.deferred:
                request.score_deferred(self.caches, self.layout)  # at the copy: every layer
            t1 = time.perf_counter()
            if request.masks is None:
                request.select(self.space)
            t2 = time.perf_counter()
            dest = torch.arange(self.num_blocks - self.keep_blocks, self.num_blocks)
            torch_writes = CPU_AMX if self.layout is CPU_AMX_PACKED else CPU_VEC
            copy_layout = torch_writes if mode == "scored_ahead_torch_writes" else self.layout
            compact_request(self.caches, self.row, request.masks, dest, self.space, copy_layout)
            t3 = time.perf_counter()
        finally:
            compression.DEFERRED_LAYERS_BYTES, copying.COPY_GROUP_BYTES = saved, saved_copy
        return {
            "copy_step_ms": (t3 - t0) * 1e3,
            "score_at_copy_ms": (t1 - t0) * 1e3,
            "select_ms": (t2 - t1) * 1e3,
            "select_ahead_ms": select_ahead * 1e3,
            "copy_ms": (t3 - t2) * 1e3,
            "ahead_step_ms": max(ahead, default=0.0) * 1e3,
            "ahead_total_ms": sum(ahead) * 1e3,
        }


def run(sizes: list[int], rounds: int, layout_choice: str = "auto") -> dict:
    layout, dtype = machine_layout(layout_choice)
    results = {}
    for n in sizes:
        setup = Setup(n, layout, dtype)
        for mode in MODES:  # warm-up: allocator, oneDNN primitives
            setup.compaction(mode)
        per_round: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for _ in tqdm(range(rounds), desc=f"n={n}", file=sys.stderr):
            for mode in MODES:
                per_round[mode].append(setup.compaction(mode))
        summary: dict = {
            mode: {part: statistics.median(r[part] for r in rows) for part in rows[0]}
            for mode, rows in per_round.items()
        }
        # within each round, the copy step's stall against scoring it layer by layer at the copy (as before)
        for mode in MODES[1:]:
            summary[mode]["copy_step_vs_layer_by_layer"] = statistics.median(
                r["copy_step_ms"] / base["copy_step_ms"] for r, base in zip(per_round[mode], per_round[MODES[0]])
            )
        summary["scored_ahead"]["copy_vs_copy_by_layer"] = statistics.median(
            r["copy_ms"] / base["copy_ms"]
            for r, base in zip(per_round["scored_ahead"], per_round["scored_ahead_copy_by_layer"])
        )
        summary["scored_ahead"]["copy_vs_torch_writes"] = statistics.median(
            r["copy_ms"] / base["copy_ms"]
            for r, base in zip(per_round["scored_ahead"], per_round["scored_ahead_torch_writes"])
        )
        results[str(n)] = summary
        print(
            f"n={n}: copy step (ms) layer_by_layer {summary['layer_by_layer']['copy_step_ms']:.1f}, "
            f"stacked {summary['stacked']['copy_step_ms']:.1f}, "
            f"scored_ahead {summary['scored_ahead']['copy_step_ms']:.1f} "
            f"(copy {summary['scored_ahead']['copy_ms']:.1f}, "
            f"selected ahead {summary['scored_ahead']['select_ahead_ms']:.1f}, "
            f"copied layer by layer {summary['scored_ahead_copy_by_layer']['copy_ms']:.1f}; "
            f"longest step before it {summary['scored_ahead']['ahead_step_ms']:.1f})"
        )
    return {"layout": type(layout).__name__, "dtype": str(dtype), "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="*", default=[320, 2000, 8000], help="prompt tokens")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (an engine's, here 1)")
    parser.add_argument(
        "--layout", choices=("auto", "amx", "vec"), default="auto", help="the cache layout (auto: this CPU's)"
    )
    parser.add_argument("--json", default=str(RESULTS))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    measured = run(args.sizes, args.rounds, args.layout)
    report = {
        "benchmark": "compaction_step",
        "shapes": dict(layers=LAYERS, kv_heads=KV_HEADS, query_heads=KV_HEADS * GROUP, head_dim=HEAD_DIM, block=BLOCK),
        "threads": args.threads,
        "rounds": args.rounds,
        "settings": "the bare flag (RC, budget 0.4 model-wide, lazy: scored at the copy)",
        "copy_group_bytes": copying.COPY_GROUP_BYTES,
        **measured,
        "wall_s": round(time.perf_counter() - start, 1),
        "environment": environment(),
    }
    write_report(report, Path(args.json), lambda report: None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
