"""Scoring overhead: RC (Eq. 6, GQA mean) and SnapKV against the plain matmul of the same logits.

Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, head_dim 128), one request, one layer, prompt
lengths n (default 4k, 16k, 64k). RC uses a window of w = 8 queries, SnapKV its default 64. Each method's
ratio is taken against ``q_window @ K^T`` with the same w: the cost every logit-based scorer must pay.

Besides the paper's scores, RC as the plugin ships it (its knobs' defaults, w = 32) scores a paged cache the way the
engine does (``Scorer.score_paged``: the torch gather on a CPU, the Triton kernel on CUDA), once as the defaults are
and once weighted by the values' norms (``value_weight`` 1, issue 56: the only row that reads the value cache); the
second's ratio is taken against the first (``baseline``), the cost of value weighting; and once with scores averaged
over chunks of 4 tokens (``chunk`` 4, an option: issue 56), against the first too.

* CPU (always): the torch paths the engine runs on vLLM-CPU, float32.
* CUDA (when available): the torch paths plus the Triton kernels reading a paged bf16 cache.

    python benchmarks/scoring.py                       # writes benchmarks/results/scoring_<device>.json
    python benchmarks/scoring.py --sizes 4096 --repeats 3 --json /tmp/s.json
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from rcstat_vllm.scoring import PagedPrompt, RCScorer, SnapKVScorer

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
RC_WINDOW, SNAPKV_WINDOW = 8, 64
SHIPPED_RC_WINDOW = 32  # RCScorer()'s (the config's default window)
PAGE_SIZE = 16
RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Timing:
    n: int
    method: str
    window: int
    baseline: str  # the matmul row this method's ratio refers to
    repeats: int
    ms_median: float
    ms_min: float
    ratio_vs_matmul: float | None = None


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def time_round_robin(fns: list[Callable[[], object]], repeats: int, device: torch.device) -> list[list[float]]:
    """Wall times in ms, ``repeats`` per function, after one warm-up call each.

    The functions take turns (one call each per round) so that load from other processes on a shared
    machine lands on every method alike instead of on whichever happened to run during a busy spell; every other
    round runs them in reverse, so what a call leaves behind (caches, the allocator's free lists) favours no one:
    in a fixed order RC with chunks of 4 timed 1.10-1.24x the row before it at 16k tokens, alternating 1.06x.
    """

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) * 1e3

    for fn in fns:
        timed(fn)
    samples: list[list[float]] = [[] for _ in fns]
    turns = list(zip(fns, samples))
    for round_ in range(repeats):
        for fn, times in turns if round_ % 2 == 0 else reversed(turns):
            times.append(timed(fn))
    return samples


def repeats_for(n: int, repeats: int) -> int:
    """Fewer repeats at long prompts (each run is longer and its timing steadier), at least 2."""
    return max(2, min(repeats, round(repeats * 16384 / n)))


def make_inputs(n: int, device: torch.device, dtype: torch.dtype, generator: torch.Generator):
    keys = torch.randn(NUM_KV_HEADS, n, HEAD_DIM, generator=generator).to(device, dtype)
    queries = torch.randn(NUM_Q_HEADS, SNAPKV_WINDOW, HEAD_DIM, generator=generator).to(device, dtype)
    # Realistic logits: RoPE'd queries and keys are correlated; plain Gaussians are enough for timing.
    return queries, keys


def paged_cache(keys: torch.Tensor, perm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same keys in a vLLM-style cache [blocks, Hkv, page, d] under a shuffled block table (``perm``: a given
    one, so values land on their keys' pages)."""
    n = keys.shape[1]
    pages = math.ceil(n / PAGE_SIZE)
    padded = torch.nn.functional.pad(keys, (0, 0, 0, pages * PAGE_SIZE - n))
    ordered = padded.reshape(NUM_KV_HEADS, pages, PAGE_SIZE, HEAD_DIM).transpose(0, 1)
    if perm is None:
        perm = torch.randperm(pages, device=keys.device)
    cache = torch.empty_like(ordered)
    cache[perm.long()] = ordered
    return cache.contiguous(), perm.to(torch.int32)


def shipped_rc_rows(n: int, queries: torch.Tensor, keys: torch.Tensor, device: torch.device) -> list[tuple]:
    """RC with the plugin's defaults through ``score_paged`` over a paged key and value cache, as they are, with
    ``value_weight`` 1, with ``chunk`` 4 and with ``group_reduction`` max (the baseline of each the first: what each
    adds)."""
    values = torch.randn_like(keys)
    key_cache, table = paged_cache(keys)
    value_cache, _ = paged_cache(values, table)
    prompt = PagedPrompt(key_cache, value_cache, table, n)
    q_window = queries[:, -SHIPPED_RC_WINDOW:]
    use_triton = device.type == "cuda"
    path = "triton paged" if use_triton else "torch paged"
    plain, weighted, chunked = RCScorer(), RCScorer(value_weight=1.0), RCScorer(chunk=4)
    group_max = RCScorer(group_reduction="max")
    return [
        (f"rc shipped {path}", SHIPPED_RC_WINDOW, None, lambda: plain.score_paged(q_window, prompt, 1.0, use_triton)),
        (
            f"rc shipped value_weight 1 {path}",
            SHIPPED_RC_WINDOW,
            f"rc shipped {path}",
            lambda: weighted.score_paged(q_window, prompt, 1.0, use_triton),
        ),
        (
            f"rc shipped chunk 4 {path}",
            SHIPPED_RC_WINDOW,
            f"rc shipped {path}",
            lambda: chunked.score_paged(q_window, prompt, 1.0, use_triton),
        ),
        (
            f"rc shipped group_reduction max {path}",
            SHIPPED_RC_WINDOW,
            f"rc shipped {path}",
            lambda: group_max.score_paged(q_window, prompt, 1.0, use_triton),
        ),
    ]


def plan(n: int, queries: torch.Tensor, keys: torch.Tensor, device: torch.device):
    """(method, window, baseline, fn) rows for one prompt length."""
    group = NUM_Q_HEADS // NUM_KV_HEADS
    scale = HEAD_DIM**-0.5
    q_rc = queries[:, -RC_WINDOW:]
    keys_t = keys.transpose(1, 2)

    def matmul(window):
        grouped = queries[:, -window:].reshape(NUM_KV_HEADS, group * window, HEAD_DIM)
        return lambda: torch.matmul(grouped, keys_t)

    rc, snapkv = RCScorer.paper(window_size=RC_WINDOW), SnapKVScorer(window_size=SNAPKV_WINDOW)
    rows = [
        (f"matmul w={RC_WINDOW}", RC_WINDOW, None, matmul(RC_WINDOW)),
        ("rc torch", RC_WINDOW, f"matmul w={RC_WINDOW}", lambda: rc.score(q_rc, keys, keys, scale)),
        (f"matmul w={SNAPKV_WINDOW}", SNAPKV_WINDOW, None, matmul(SNAPKV_WINDOW)),
        ("snapkv torch", SNAPKV_WINDOW, f"matmul w={SNAPKV_WINDOW}", lambda: snapkv.score(queries, keys, keys, scale)),
    ]
    rows += shipped_rc_rows(n, queries, keys, device)
    if device.type == "cuda":
        from rcstat_vllm.scoring.methods.rc import rc_scores_paged
        from rcstat_vllm.scoring.methods.snapkv import snapkv_scores_paged

        cache, table = paged_cache(keys)
        rows += [
            ("rc triton paged", RC_WINDOW, f"matmul w={RC_WINDOW}", lambda: rc_scores_paged(q_rc, cache, table, n)),
            (
                "snapkv triton paged",
                SNAPKV_WINDOW,
                f"matmul w={SNAPKV_WINDOW}",
                lambda: snapkv_scores_paged(queries, cache, table, n, scale),
            ),
        ]
    return rows


def run(sizes: list[int], repeats: int, device: torch.device, dtype: torch.dtype) -> list[Timing]:
    generator = torch.Generator().manual_seed(0)
    timings: list[Timing] = []
    with tqdm(total=len(sizes), desc="scoring benchmark", unit="size", file=sys.stderr) as progress:
        for n in sizes:
            queries, keys = make_inputs(n, device, dtype, generator)
            reps = repeats_for(n, repeats)
            rows = plan(n, queries, keys, device)
            progress.set_postfix_str(f"n={n}")
            samples = time_round_robin([fn for *_, fn in rows], reps, device)
            by_method: dict[str, Timing] = {}
            for (method, window, baseline, _), times in zip(rows, samples):
                timing = Timing(n, method, window, baseline or method, reps, statistics.median(times), min(times))
                if baseline is not None:
                    timing.ratio_vs_matmul = timing.ms_median / by_method[baseline].ms_median
                by_method[method] = timing
                timings.append(timing)
            progress.update(1)
            del queries, keys
    return timings


def print_table(timings: list[Timing]) -> None:
    """One line per row; ``x baseline``: its median over its baseline row's (the matmul, or RC as shipped)."""
    header = (
        f"{'n':>7}  {'method':<38} {'w':>3} {'reps':>4} {'ms (median)':>12} {'ms (min)':>10}  "
        f"{'x baseline':>10}  baseline"
    )
    print(header)
    print("-" * len(header))
    for t in timings:
        ratio = f"{t.ratio_vs_matmul:10.2f}" if t.ratio_vs_matmul is not None else f"{'1.00':>10}"
        print(
            f"{t.n:>7}  {t.method:<38} {t.window:>3} {t.repeats:>4} {t.ms_median:>12.2f} {t.ms_min:>10.2f}  {ratio}  "
            f"{t.baseline}"
        )


def _environment() -> dict:
    """benchmarks/common.py's record (commit, machine, versions), when the script runs from the checkout."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        from common import environment
    except ImportError:
        return {}
    return environment()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sizes",
        type=lambda s: [int(v) for v in s.split(",")],
        default=[4096, 16384, 65536],
        help="comma-separated prompt lengths (default 4096,16384,65536)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed runs per method at n <= 16k; fewer at longer n, at least 2 (default 5)",
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="output file (default benchmarks/results/scoring_<cpu|cuda>.json)"
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    dtype = torch.bfloat16 if use_cuda else torch.float32
    load_before = _load_average()
    timings = run(args.sizes, args.repeats, device, dtype)
    print_table(timings)

    path = args.json or RESULTS_DIR / f"scoring_{device.type}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "device": device.type,
        "device_name": device_description(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        # Other processes share the machine's cores: the 1-minute load average says how much.
        "load_average_1min": {"before": load_before, "after": _load_average()},
        "dtype": str(dtype).removeprefix("torch."),
        "shapes": {
            "q_heads": NUM_Q_HEADS,
            "kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "rc_window": RC_WINDOW,
            "snapkv_window": SNAPKV_WINDOW,
            "page_size": PAGE_SIZE,
        },
        "note": "ratio_vs_matmul = median ms / median ms of the row named by baseline: q_window @ K^T with the same "
        "window for the scorers, RC as shipped for RC as shipped with value_weight 1, chunk 4 or group_reduction max",
        "results": [asdict(t) for t in timings],
        "environment": _environment(),
    }
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import result_files

    print(f"wrote {result_files.write(report, path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
