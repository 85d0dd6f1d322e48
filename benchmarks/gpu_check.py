"""The Triton scoring kernels on a GPU at real model sizes: correctness, host synchronisations, speed.

No vLLM is needed (the kernels and scorers are torch + Triton), so this runs on any CUDA machine with torch and
Triton; put the package on the path (``pip install -e . --no-deps`` or the copy ``gpu_check.sh`` makes). Three parts:

1. **Correctness** of ``rc_scores_paged`` and ``snapkv_scores_paged`` (compiled, not interpreted) against their
   torch references in float64 on the same rounded inputs, at the attention shapes of Llama-3.1-8B, Qwen2.5-7B
   (G = 7, not a power of 2), SmolLM2-135M (d = 64) and a head size of 256, for bf16 / fp16 / fp32 caches, RC's
   default (w = 32, max over queries) and the paper's (w = 8, mean), a shuffled block table with a spare page and
   a part-full last page. Each case: relative L2 error, the top-20% keep sets' agreement with the reference's
   (what eviction uses), and that every output was written (the allocator is poisoned with NaN first).
   Then the whole default scorer (``RCScorer.score_paged`` with the contrast, smoothing and carrying) against
   the torch path on float64 copies. Decode time: RC's head-page kernel (``rc_head_scores_paged``: each KV head's
   own entries through its own page list, heads of uneven lengths) against its float64 reference at every shape
   and dtype, and the default scorer's ``score_head_pages`` against its ``score_ragged``.
2. **Host synchronisations**: the default RC scorer and SnapKV's paged path, and RC's decode-time path, under
   ``torch.cuda.set_sync_debug_mode("error")`` (a sync in a per-layer prefill hook stalls the whole step).
3. **Speed**, Llama-3.1-8B shapes, bf16, page 16, one layer, n = 4k .. 128k: the kernels and the whole default
   scorer against the layer's own causal prefill attention (``scaled_dot_product_attention``, GQA) and the plain
   ``q_window @ K^T``; RC's kernel at several ``block_n``.

    python benchmarks/gpu_check.py --json benchmarks/results/gpu_check_<card>.json
    python benchmarks/gpu_check.py --parts speed --json ...   # only some parts
    python benchmarks/gpu_check.py --smoke   # tiny sizes (CPU + TRITON_INTERPRET=1 works): checks this script
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from rcstat_vllm.kernels.decode_scoring import gather_head_entries
from rcstat_vllm.scoring import PagedPrompt, RCScorer, SnapKVScorer
from rcstat_vllm.scoring.methods.rc import (
    rc_head_scores_paged,
    rc_head_scores_paged_reference,
    rc_scores_paged,
    rc_scores_paged_reference,
)
from rcstat_vllm.scoring.methods.snapkv import snapkv_scores_paged, snapkv_scores_paged_reference

#: name -> (query heads, KV heads, head size)
SHAPES = {
    "llama3.1-8b": (32, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
    "smollm2-135m": (9, 3, 64),
    "head256": (8, 4, 256),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: (label, method, window, query reduction)
METHODS = [("rc_default", "rc", 32, "max"), ("rc_paper", "rc", 8, "mean"), ("snapkv", "snapkv", 64, None)]
#: The plugin's defaults (config.py): what a server scores with.
DEFAULT_RC = dict(
    window_size=32, smoothing=3, carry_forward=8, local_contrast=0.5, contrast_radius=256, query_reduction="max"
)
KEEP_SHARE = 0.2  # compression 0.8
#: decode-time checks: the widest head's generated entries (the others fewer, down to about half)
DECODE_N = 4099
#: decode-time scoring timed (part decode_speed): the widest head's entries
DECODE_SPEED_NS = (4096, 16384, 32768)


@dataclass
class Check:
    case: str
    rel_l2: float
    keep_agreement: float  # |top-k(got) & top-k(ref)| / k per head, mean over heads
    all_written: bool
    tolerance: float
    passed: bool = field(init=False)

    def __post_init__(self):
        self.passed = self.all_written and math.isfinite(self.rel_l2) and self.rel_l2 <= self.tolerance


def paged_cache(keys: torch.Tensor, page: int, spare_pages: int = 1, seed: int = 0):
    """keys [Hkv, n, d] -> (cache [blocks, Hkv, page, d] holding them under a shuffled block table, the table). The
    cache is the key half of a fused [blocks, 2, Hkv, page, d] tensor (a strided view, as vLLM's), with spare blocks
    of random data the table does not point at, and the table is one page longer than the prompt needs."""
    hkv, n, d = keys.shape
    pages = -(-n // page)
    blocks = pages + spare_pages + 3
    gen = torch.Generator(device="cpu").manual_seed(seed)
    fused = torch.randn(blocks, 2, hkv, page, d, generator=gen).to(keys.device, keys.dtype)
    table = torch.randperm(blocks, generator=gen)[: pages + spare_pages].to(keys.device, torch.int32)
    padded = torch.nn.functional.pad(keys, (0, 0, 0, pages * page - n))
    fused[table[:pages].long(), 0] = padded.reshape(hkv, pages, page, d).transpose(0, 1)
    return fused[:, 0], table


def poison_allocator(device: torch.device, numel: int) -> None:
    """Leave NaN in the caching allocator's free blocks of an output's size (float32 ``numel``), so that an output
    element a kernel never writes reads NaN: the allocator hands the next allocation of that size the block just
    freed. (Outputs under 1 MiB come from its small-block pool, so a large NaN buffer would not reach them.)"""
    if device.type == "cuda":
        poison = [torch.full((numel,), float("nan"), device=device) for _ in range(4)]
        torch.cuda.synchronize(device)
        del poison


def keep_agreement(got: torch.Tensor, ref: torch.Tensor, share: float = KEEP_SHARE) -> float:
    k = max(1, int(share * got.shape[-1]))
    agree = []
    for g, r in zip(got.double(), ref.double()):
        top_g = set(torch.topk(g, k).indices.tolist())
        top_r = set(torch.topk(r, k).indices.tolist())
        agree.append(len(top_g & top_r) / k)
    return sum(agree) / len(agree)


def compare(case: str, got: torch.Tensor, ref: torch.Tensor, tolerance: float) -> Check:
    finite = torch.isfinite(ref)
    all_written = bool(torch.isfinite(got[finite]).all()) and bool((torch.isinf(got) == torch.isinf(ref)).all())
    diff = (got.double() - ref.double())[finite]
    rel = (diff.norm() / ref.double()[finite].norm().clamp_min(1e-300)).item()
    g = torch.where(torch.isfinite(got), got.double(), torch.full_like(got.double(), 1e300))
    r = torch.where(finite, ref.double(), torch.full_like(ref.double(), 1e300))
    return Check(case, rel, keep_agreement(g, r), all_written, tolerance)


#: ||got - ref|| / ||ref|| allowed: products of 16-bit inputs are exact in float32, so only the float32 accumulation
#: order differs from the float64 reference, but RC's count * x - prefix subtracts nearly equal sums.
TOLERANCE = {"fp32": 1e-4, "fp16": 1e-3, "bf16": 1e-3}


def kernel_checks(device, sizes, shapes, dtypes, page, progress) -> list[Check]:
    checks = []
    for shape_name in shapes:
        hq, hkv, d = SHAPES[shape_name]
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            for n in sizes:
                gen = torch.Generator(device="cpu").manual_seed(n + hq + d)
                # Keys with a per-channel offset and queries near them (RoPE'd keys are not centred), rounded once
                # to the cache dtype: the reference sees exactly the values the kernel reads.
                offset = torch.randn(hkv, 1, d, generator=gen)
                keys = (torch.randn(hkv, n, d, generator=gen) + offset).to(device, dtype)
                queries = (torch.randn(hq, 64, d, generator=gen)).to(device, dtype)
                cache, table = paged_cache(keys, page, seed=n)
                cache64, q64 = cache.double(), queries.double()
                for label, method, window, reduction in METHODS:
                    case = f"{shape_name} {dtype_name} n={n} {label}"
                    progress(case)
                    q = queries[:, -window:]
                    poison_allocator(device, hkv * n)  # the kernels' first allocation: the [Hkv, n - w] output
                    if method == "rc":
                        got = rc_scores_paged(q, cache, table, n, query_reduction=reduction)
                        ref = rc_scores_paged_reference(q64[:, -window:], cache64, table, n, reduction)
                    else:
                        scale = d**-0.5
                        got = snapkv_scores_paged(q, cache, table, n, scale)
                        ref = snapkv_scores_paged_reference(q64[:, -window:], cache64, table, n, scale)
                    checks.append(compare(case, got, ref, TOLERANCE[dtype_name]))
    return checks


def head_pages(hkv: int, d: int, n: int, page: int, dtype, device, seed: int = 0):
    """Decode-time head pages: a FLASH-layout cache's key half ``[blocks, Hkv, page, d]`` (keys with a per-channel
    offset), and per KV head its own page list of distinct pages drawn from every block and head slot (as a pooled
    space hands them out), a spare page and -1 after; each head scored from its own first entry (a few pages in)
    over its own count (uneven: up to ``n``). Returns (key view, page lists, starts, counts) with host starts/counts."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    counts = torch.tensor([n - n // (2 * hkv) * h for h in range(hkv)])  # the last head holds about half
    starts = torch.randint(0, 3 * page, (hkv,), generator=gen)
    needed = -(-int((starts + counts).max()) // page) + 1
    blocks = needed + 8  # (a block holds Hkv pages: every head's list fits, with blocks to spare)
    fused = torch.randn(blocks, hkv, page, 2 * d, generator=gen)
    fused[..., :d] += torch.randn(d, generator=gen)
    pages = torch.full((hkv, needed + 1), -1, dtype=torch.int64)
    pages[:, :needed] = torch.randperm(blocks * hkv, generator=gen)[: hkv * needed].view(hkv, needed)
    return fused.to(device, dtype)[..., :d], pages.to(device), starts, counts


def decode_checks(device, n, shapes, dtypes, page, progress) -> list[Check]:
    """The decode-time head-page kernel (``rc_head_scores_paged``) against its float64 reference on the same rounded
    inputs: RC's default and the paper's window, every shape and dtype, heads of uneven lengths up to ``n``."""
    checks = []
    for shape_name in shapes:
        hq, hkv, d = SHAPES[shape_name]
        for dtype_name in dtypes:
            cache, pages, starts, counts = head_pages(hkv, d, n, page, DTYPES[dtype_name], device, seed=n + hq + d)
            gen = torch.Generator(device="cpu").manual_seed(hq + d)
            queries = torch.randn(hq, 32, d, generator=gen).to(device, DTYPES[dtype_name])
            for label, method, window, reduction in METHODS:
                if method != "rc":
                    continue
                case = f"decode {shape_name} {dtype_name} n<={n} {label}"
                progress(case)
                q = queries[:, -window:]
                got = rc_head_scores_paged(q, cache, pages, starts, counts, reduction)
                ref = rc_head_scores_paged_reference(q.double(), cache.double(), pages, starts, counts, reduction)
                checks.append(compare(case, got, ref, TOLERANCE[dtype_name]))
    return checks


def decode_scorer_check(device, n, page, dtype_name, progress) -> list[Check]:
    """The default RC scorer at decode time: the head-page kernel path (``score_head_pages``) against the torch path
    (``score_ragged`` on the gathered entries) on float64 copies; each head's finished scores, right-aligned."""
    hq, hkv, d = SHAPES["llama3.1-8b"]
    cache, pages, starts, counts = head_pages(hkv, d, n, page, DTYPES[dtype_name], device, seed=5)
    queries = torch.randn(hq, 32, d, generator=torch.Generator().manual_seed(5)).to(device, DTYPES[dtype_name])
    scorer = RCScorer(**DEFAULT_RC)
    progress("rc default decode scorer")
    got = scorer.score_head_pages(queries, cache, pages, starts, counts, d**-0.5)
    width = int(counts.max())
    keys = gather_head_entries(cache, pages, starts, counts, width).double()
    ref = scorer.score_ragged(queries.double(), keys, None, counts.tolist(), d**-0.5)  # type: ignore[arg-type]
    # (both right-aligned [H, width], -inf before each head's entries: compare checks the infinities agree)
    return [compare(f"rc default decode scorer {dtype_name} n<={n}", got.double(), ref.double(), TOLERANCE[dtype_name])]


def decode_speed(device, ns, page, progress, dtype_name: str = "bf16") -> list[dict]:
    """Decode-time scoring timed, one layer of one request at Llama-3.1-8B shapes: the default RC scorer's head-page
    kernel (``score_head_pages``, what a decode-time compaction runs per layer, reading each KV head's entries in
    place) against the torch path it replaces (each head's entries gathered, then ``score_ragged``). Heads of uneven
    lengths up to ``n`` (:func:`head_pages`); milliseconds (:func:`bench`)."""
    hq, hkv, d = SHAPES["llama3.1-8b"]
    scorer = RCScorer(**DEFAULT_RC)
    rows = []
    for n in ns:
        progress(f"decode-time scoring speed n<={n}")
        cache, pages, starts, counts = head_pages(hkv, d, n, page, DTYPES[dtype_name], device, seed=n)
        q = torch.randn(hq, 32, d, generator=torch.Generator().manual_seed(n)).to(device, DTYPES[dtype_name])
        width, lengths = int(counts.max()), counts.tolist()

        def kernel(q=q, cache=cache, pages=pages, starts=starts, counts=counts):
            return scorer.score_head_pages(q, cache, pages, starts, counts, d**-0.5)

        def torch_path(q=q, cache=cache, pages=pages, starts=starts, counts=counts, width=width, lengths=lengths):
            keys = gather_head_entries(cache, pages, starts, counts, width)
            return scorer.score_ragged(q, keys, None, lengths, d**-0.5)  # type: ignore[arg-type]

        kernel_ms, torch_ms = bench(kernel, device), bench(torch_path, device)
        rows.append(
            {
                "n": n,
                "dtype": dtype_name,
                "entries": int(counts.sum()),
                "kernel_ms_median": kernel_ms,
                "torch_ms_median": torch_ms,
                "kernel_vs_torch": kernel_ms / torch_ms if torch_ms else None,
            }
        )
    return rows


def scorer_check(device, n, page, dtype_name, progress) -> list[Check]:
    """The whole default RC scorer (and SnapKV's) through the Triton path against the torch path on float64 copies."""
    hq, hkv, d = SHAPES["llama3.1-8b"]
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device="cpu").manual_seed(7)
    keys = (torch.randn(hkv, n, d, generator=gen) + torch.randn(hkv, 1, d, generator=gen)).to(device, dtype)
    queries = torch.randn(hq, 32, d, generator=gen).to(device, dtype)
    cache, table = paged_cache(keys, page, seed=1)
    checks = []
    for label, scorer in [("rc default scorer", RCScorer(**DEFAULT_RC)), ("snapkv scorer", SnapKVScorer())]:
        progress(label)
        q = queries if scorer.name == "rc" else torch.randn(hq, 64, d, generator=gen).to(device, dtype)
        prompt = PagedPrompt(cache, cache, table, n)
        got = scorer.score_paged(q, prompt, d**-0.5, use_triton=True)
        ref = scorer.score(q.double(), keys.double(), keys.double(), d**-0.5)
        checks.append(compare(f"{label} {dtype_name} n={n}", got, ref, TOLERANCE[dtype_name]))
    return checks


def sync_check(device, n, page) -> dict[str, str]:
    """'none' or the error torch raised at the first host synchronisation of each paged scorer."""
    if device.type != "cuda":
        return {"skipped": "not on CUDA"}
    hq, hkv, d = SHAPES["llama3.1-8b"]
    keys = torch.randn(hkv, n, d, device=device, dtype=torch.bfloat16)
    cache, table = paged_cache(keys, page)
    prompt = PagedPrompt(cache, cache, table, n)
    found = {}
    for label, scorer, window in [("rc default", RCScorer(**DEFAULT_RC), 32), ("snapkv", SnapKVScorer(), 64)]:
        q = torch.randn(hq, window, d, device=device, dtype=torch.bfloat16)
        scorer.score_paged(q, prompt, d**-0.5, use_triton=True)  # compile first: compilation may sync
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            scorer.score_paged(q, prompt, d**-0.5, use_triton=True)
            found[label] = "none"
        except RuntimeError as exc:
            found[label] = str(exc).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    cache, pages, starts, counts = head_pages(hkv, d, 4096, page, torch.bfloat16, device)
    q = torch.randn(hq, 32, d, device=device, dtype=torch.bfloat16)
    scorer = RCScorer(**DEFAULT_RC)
    scorer.score_head_pages(q, cache, pages, starts, counts, d**-0.5)  # compile first
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        scorer.score_head_pages(q, cache, pages, starts, counts, d**-0.5)
        found["rc default decode"] = "none"
    except RuntimeError as exc:
        found["rc default decode"] = str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return found


def bench(fn, device) -> float:
    """Median milliseconds (CUDA events via triton.testing.do_bench on a GPU; wall clock elsewhere)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=50, rep=300, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def bench_graph(fn, device) -> float | None:
    """Median milliseconds of ``fn`` replayed from a CUDA graph: its GPU time without the host's launch gaps. In a
    prefill step the host queues the next launches while the GPU runs the layer's large matrix products, so a
    scorer's many small launches cost about this much there; timed eagerly (:func:`bench`) on an idle GPU they cost
    their launch overhead instead. None off CUDA."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up on a side stream, as torch.cuda.graphs asks
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay, device)


def speed(device, sizes, page, block_ns, progress) -> list[dict]:
    hq, hkv, d = SHAPES["llama3.1-8b"]
    group = hq // hkv
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for n in sizes:
        gen = torch.Generator(device="cpu").manual_seed(n)
        keys = torch.randn(hkv, n, d, generator=gen).to(device, dtype)
        cache, table = paged_cache(keys, page, seed=n)
        q_all = torch.randn(hq, 64, d, generator=gen).to(device, dtype)
        prompt = PagedPrompt(cache, cache, table, n)
        default_rc, snapkv = RCScorer(**DEFAULT_RC), SnapKVScorer()

        def window_matmul(w):
            grouped = q_all[:, -w:].reshape(hkv, group * w, d)
            return lambda: torch.matmul(grouped, keys.transpose(1, 2))

        plan = [
            ("window matmul w=32", window_matmul(32)),
            (
                "rc kernel w=32 max (default)",
                lambda: rc_scores_paged(q_all[:, -32:], cache, table, n, query_reduction="max"),
            ),
            ("rc kernel w=8 mean (paper)", lambda: rc_scores_paged(q_all[:, -8:], cache, table, n)),
            (
                "rc default scorer (kernel + contrast + smoothing + carry)",
                lambda: default_rc.score_paged(q_all[:, -32:], prompt, d**-0.5, use_triton=True),
            ),
            ("snapkv kernel w=64", lambda: snapkv_scores_paged(q_all, cache, table, n, d**-0.5)),
            ("snapkv scorer", lambda: snapkv.score_paged(q_all, prompt, d**-0.5, use_triton=True)),
        ]
        plan += [
            (
                f"rc kernel w=32 max block_n={bn}",
                (lambda bn=bn: rc_scores_paged(q_all[:, -32:], cache, table, n, block_n=bn, query_reduction="max")),
            )
            for bn in block_ns
        ]
        if device.type == "cuda":
            q_layer = torch.randn(1, hq, n, d, device=device, dtype=dtype)
            kv_layer = torch.randn(2, 1, hkv, n, d, device=device, dtype=dtype)

            def attention():
                return torch.nn.functional.scaled_dot_product_attention(
                    q_layer, kv_layer[0], kv_layer[1], is_causal=True, enable_gqa=True
                )

            # A whole decoder layer's prefill work (Llama-3.1-8B: hidden 4096, MLP 14336): the QKV and output
            # projections, the attention and the gated MLP's three products, on stand-in activations. The scorer runs
            # inside this step on the same stream; "layer + scorer" minus "layer" is what it adds there.
            hidden, mlp = hq * d, 14336
            x = torch.randn(n, hidden, device=device, dtype=dtype) * 0.02
            w_qkv = torch.randn(hidden, (hq + 2 * hkv) * d, device=device, dtype=dtype) * 0.02
            w_o = torch.randn(hidden, hidden, device=device, dtype=dtype) * 0.02
            w_gate_up = torch.randn(hidden, 2 * mlp, device=device, dtype=dtype) * 0.02
            w_down = torch.randn(mlp, hidden, device=device, dtype=dtype) * 0.02

            def layer():
                torch.matmul(x, w_qkv)
                out = torch.matmul(attention().transpose(1, 2).reshape(n, hidden), w_o)
                gate, up = torch.matmul(x + out, w_gate_up).chunk(2, dim=-1)
                return torch.matmul(torch.nn.functional.silu(gate) * up, w_down)

            def layer_and(scorer_call):
                def run():
                    layer()
                    return scorer_call()

                return run

            default_call = plan[3][1] if plan[3][0].startswith("rc default scorer") else None
            assert default_call is not None
            snapkv_call = next(fn for label, fn in plan if label == "snapkv scorer")
            plan.insert(0, ("layer prefill attention (sdpa, causal, GQA)", attention))
            plan += [
                ("decoder layer prefill (projections, attention, MLP)", layer),
                ("decoder layer + rc default scorer", layer_and(default_call)),
                ("decoder layer + snapkv scorer", layer_and(snapkv_call)),
            ]
        timings, graphed = {}, {}
        for label, fn in plan:
            progress(f"n={n} {label}")
            timings[label] = bench(fn, device)
            graphed[label] = bench_graph(fn, device)
        attention = "layer prefill attention (sdpa, causal, GQA)"
        base, graph_base = timings.get(attention), graphed.get(attention)
        key_bytes = hkv * n * d * keys.element_size()
        for label, ms in timings.items():
            graph_ms = graphed[label]
            rows.append(
                {
                    "n": n,
                    "what": label,
                    "ms_median": round(ms, 4),
                    "vs_layer_attention": None if base is None else round(ms / base, 4),
                    "graph_ms_median": None if graph_ms is None else round(graph_ms, 4),
                    "graph_vs_layer_attention": None if graph_base is None else round(graph_ms / graph_base, 4),
                    # The keys each scoring kernel must read once, over the time: how close to memory bandwidth it runs.
                    "key_read_GBps": round(key_bytes / (min(ms, graph_ms or ms) * 1e-3) / 1e9, 1)
                    if "kernel" in label
                    else None,
                }
            )
        layer_ms, layer_graph_ms = (
            timings.get("decoder layer prefill (projections, attention, MLP)"),
            graphed.get("decoder layer prefill (projections, attention, MLP)"),
        )
        for label in ("decoder layer + rc default scorer", "decoder layer + snapkv scorer"):
            if layer_ms is not None:
                rows.append(
                    {
                        "n": n,
                        "what": f"added by the scorer: {label.split(' + ')[1]}",
                        "ms_median": round(timings[label] - layer_ms, 4),
                        "vs_layer_attention": round(timings[label] / layer_ms - 1, 4),
                        "graph_ms_median": round(graphed[label] - layer_graph_ms, 4),
                        "graph_vs_layer_attention": round(graphed[label] / layer_graph_ms - 1, 4),
                        "key_read_GBps": None,
                        "note": "ms: layer + scorer minus layer; ratio columns: share of the layer's time",
                    }
                )
        plan.clear()  # the closures hold this size's tensors
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None, help="where the results go (default: print only)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, fp32 and fp16 only: checks the script")
    parser.add_argument(
        "--parts",
        default="correctness,syncs,speed",
        help="comma-separated: correctness (kernels and scorers against references), syncs, speed, decode_speed",
    )
    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    parser.add_argument("--shapes", type=lambda t: t.split(","), default=list(SHAPES), help=f"of {list(SHAPES)}")
    parser.add_argument("--dtypes", type=lambda t: t.split(","), default=list(DTYPES), help=f"of {list(DTYPES)}")
    parser.add_argument("--speed-sizes", type=ints, default=[4096, 16384, 65536, 131072])
    parser.add_argument("--block-ns", type=ints, default=[32, 64, 128], help="RC kernel tile widths to time")
    parser.add_argument("--decode-sizes", type=ints, default=list(DECODE_SPEED_NS), help="part decode_speed's n")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    page = 16  # vLLM's default block size on CUDA
    if args.smoke:
        check_sizes, shapes, dtypes, scorer_n, decode_n = [75], ["smollm2-135m"], ["fp32", "fp16"], 300, 120
        speed_sizes, block_ns, decode_ns = [256], [32], [120]
    else:
        check_sizes, shapes, dtypes, scorer_n, decode_n = [8191, 32771], args.shapes, args.dtypes, 16381, DECODE_N
        speed_sizes, block_ns, decode_ns = args.speed_sizes, args.block_ns, args.decode_sizes

    started = time.time()

    def progress(what):
        print(f"[{time.time() - started:6.1f}s] {what}", file=sys.stderr, flush=True)

    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "page_size": page,
    }
    parts = set(args.parts.split(","))
    checks = []
    if "correctness" in parts:
        checks += kernel_checks(device, check_sizes[:1], shapes, dtypes, page, progress)
        checks += kernel_checks(device, check_sizes[1:], shapes[:1], dtypes[:1], page, progress)
        # The interpreter cannot multiply bf16 tiles (it takes their raw uint16 storage): fp16 there.
        checks += scorer_check(device, scorer_n, page, "bf16" if device.type == "cuda" else "fp16", progress)
        checks += decode_checks(device, decode_n, shapes, dtypes, page, progress)
        checks += decode_scorer_check(device, decode_n, page, "bf16" if device.type == "cuda" else "fp16", progress)
        report["correctness"] = [asdict(c) for c in checks]
    if "syncs" in parts:
        report["host_syncs"] = sync_check(device, scorer_n, page)
    if "speed" in parts:
        report["speed"] = speed(device, speed_sizes, page, block_ns, progress)
    if "decode_speed" in parts:
        # The interpreter cannot multiply bf16 tiles: fp16 there.
        dtype_name = "bf16" if device.type == "cuda" else "fp16"
        report["decode_speed"] = decode_speed(device, decode_ns, page, progress, dtype_name)
    report["seconds"] = round(time.time() - started, 1)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:  # the commit, machine and versions it ran with (benchmarks/common.py), as every result file records
        from common import environment

        report["environment"] = environment(parts=sorted(parts))
    except ImportError:
        pass
    if args.json:
        import result_files  # (benchmarks/ is on sys.path: see above)

        result_files.write(report, args.json)

    print(f"\n{report['device']}, torch {report['torch']}, triton {report['triton']}")
    print(f"{'correctness case':<44} {'rel L2':>9} {'keep agr.':>9} {'written':>7}  ok")
    for c in checks:
        print(
            f"{c.case:<44} {c.rel_l2:9.2e} {c.keep_agreement:9.4f} {c.all_written!s:>7}  {'ok' if c.passed else 'FAIL'}"
        )
    if "host_syncs" in report:
        print(f"host synchronisations: {report['host_syncs']}")
    if report.get("speed"):
        print(
            f"{'':8} {'one layer, Llama-3.1-8B shapes':<58} {'eager ms':>9} {'x attn':>7} {'graph ms':>9} {'x attn':>7}"
        )
    for row in report.get("speed", []):
        cells = [
            f"{row[k]:9.3f}" if isinstance(row[k], float) else f"{'-':>9}"
            for k in ("ms_median", "vs_layer_attention", "graph_ms_median", "graph_vs_layer_attention")
        ]
        bw = "" if row["key_read_GBps"] is None else f"  {row['key_read_GBps']:7.1f} GB/s"
        print(f"n={row['n']:>6} {row['what']:<58} {cells[0]} {cells[1]:>7} {cells[2]} {cells[3]:>7}{bw}")
    for row in report.get("decode_speed", []):
        print(
            f"decode-time RC scoring, one layer, n<={row['n']:>6} {row['dtype']}: head-page kernel "
            f"{row['kernel_ms_median']:.3f} ms, torch path {row['torch_ms_median']:.3f} ms"
        )
    failed = [c.case for c in checks if not c.passed]
    print(f"{len(checks) - len(failed)} of {len(checks)} checks passed" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
