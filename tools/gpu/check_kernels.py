#!/usr/bin/env python3
"""Check 4: the Triton RC and SnapKV paged scoring kernels on the GPU, in bf16, against their torch references.

Parts (each recorded separately in kernels.json; a failure in one does not stop the next):

1. ``kernels``: ``rc_scores_paged`` / ``snapkv_scores_paged`` on CUDA against ``*_reference`` run on float64 copies
   of the same (bf16-rounded) inputs, at Llama-3.1-8B shapes (32 query heads, 8 KV heads, head_dim 128), pages of
   16 tokens in vLLM's CUDA layout ([blocks, H, N, 2D], keys the first half of each row, a scrambled block table),
   prompts of 4k/16k/32k tokens, RC windows 8 and 32, SnapKV's 64. Reported: relative error ||got - ref|| / ||ref||,
   max abs error, NaNs, and how much of the reference's top-20% (what a 0.8 budget keeps) the kernel's top-20%
   recovers. float32 inputs too (must match to ~1e-6).
2. ``live_path``: ``RequestCompressor.observe_layer`` (what the CUDA backend calls per layer) with the Triton kernels
   against the same call forced onto the torch path, bf16 cache on the GPU.
3. ``pytest``: tests/test_kernels.py, tests/test_paged_scoring.py (they run the kernels under TRITON_INTERPRET=1 on
   CPU tensors, as in CI; run here only to show the suite passes on this image).
4. ``bench``: benchmarks/scoring.py --device cuda (timings; written as scoring_<device>.json).

    python tools/gpu/check_kernels.py                 # all parts, writes kernels.json
    python tools/gpu/check_kernels.py --parts kernels,live_path --sizes 4096,16384
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import gpu_common

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
# Pass criteria in bf16 (inputs rounded to bf16 for both sides; the kernel's dot products accumulate in fp32).
BF16_REL_TOL, FP32_REL_TOL, TOPK_RECALL_MIN = 1e-2, 1e-4, 0.97


def flash_cache(n: int, dtype, gen, device):
    """A vLLM-CUDA-layout cache [B, H, N, 2D] with a spare page, scrambled block table; returns (key view, table)."""
    import torch

    pages = -(-n // PAGE) + 1
    num_blocks = pages + 7
    cache = torch.randn(num_blocks, NUM_KV_HEADS, PAGE, 2 * HEAD_DIM, generator=gen).to(device=device, dtype=dtype)
    table = torch.randperm(num_blocks, generator=gen)[:pages].to(device=device, dtype=torch.int32)
    return cache, cache[..., :HEAD_DIM], table


def compare(got, ref, keep: float = 0.2) -> dict:
    import torch

    got64, ref64 = got.double(), ref.double()
    finite = torch.isfinite(ref64)
    diff = (got64 - ref64)[finite]
    rel = (diff.norm() / ref64[finite].norm().clamp_min(1e-300)).item()
    k = max(1, int(keep * ref.shape[-1]))
    top_ref = ref64.topk(k, dim=-1).indices
    top_got = got64.topk(k, dim=-1).indices
    recall = []
    for h in range(ref.shape[0]):
        a = set(top_ref[h].tolist())
        recall.append(len(a & set(top_got[h].tolist())) / k)
    return {"rel_err": rel, "max_abs_err": diff.abs().max().item() if diff.numel() else 0.0,
            "nan_in_kernel": int(torch.isnan(got64).sum()), "shape": list(got.shape),
            "top20_recall_min": min(recall), "top20_recall_mean": sum(recall) / len(recall)}


def part_kernels(sizes: list[int]) -> dict:
    import torch

    from rcstat_vllm.kernels.rc_scoring import rc_scores_paged, rc_scores_paged_reference
    from rcstat_vllm.kernels.snapkv_scoring import snapkv_scores_paged, snapkv_scores_paged_reference

    device = torch.device("cuda")
    rows, ok = [], True
    scale = HEAD_DIM**-0.5
    for n in sizes:
        for method, window in (("rc", 8), ("rc", 32), ("snapkv", 64)):
            for dtype in (torch.bfloat16, torch.float32):
                gen = torch.Generator().manual_seed(n + window)
                _, keys, table = flash_cache(n, dtype, gen, device)
                q = torch.randn(NUM_Q_HEADS, window, HEAD_DIM, generator=gen).to(device=device, dtype=dtype)
                # Poison-free: outputs are fresh tensors; a NaN shows an unwritten or wrong element.
                torch.cuda.synchronize()
                t = time.perf_counter()
                if method == "rc":
                    got = rc_scores_paged(q, keys, table, n)
                else:
                    got = snapkv_scores_paged(q, keys, table, n, scale=scale)
                torch.cuda.synchronize()
                first_call_s = time.perf_counter() - t
                q64, k64 = q.double(), keys.double()
                if method == "rc":
                    ref = rc_scores_paged_reference(q64, k64, table, n)
                else:
                    ref = snapkv_scores_paged_reference(q64, k64, table, n, scale=scale)
                row = {"method": method, "window": window, "n": n, "dtype": str(dtype).replace("torch.", ""),
                       "first_call_s": round(first_call_s, 3), **compare(got, ref)}
                tol = BF16_REL_TOL if dtype == torch.bfloat16 else FP32_REL_TOL
                row["ok"] = (row["rel_err"] <= tol and row["nan_in_kernel"] == 0
                             and row["top20_recall_min"] >= (TOPK_RECALL_MIN if dtype == torch.bfloat16 else 0.999))
                ok = ok and row["ok"]
                rows.append(row)
                print(f"[kernels] {method} w={window} n={n} {row['dtype']}: rel {row['rel_err']:.2e} "
                      f"recall {row['top20_recall_min']:.3f} {'ok' if row['ok'] else 'FAIL'}", file=sys.stderr, flush=True)
                del got, ref, q, keys, table, q64, k64
                torch.cuda.empty_cache()
    return {"ok": ok, "criteria": {"bf16_rel_err": BF16_REL_TOL, "fp32_rel_err": FP32_REL_TOL,
                                   "bf16_top20_recall_min": TOPK_RECALL_MIN}, "rows": rows}


def part_live_path(n: int = 8192) -> dict:
    """observe_layer as the CUDA backend runs it (Triton) vs the same call on the torch path, bf16 on the GPU."""
    import torch

    import rcstat_vllm.compression as compression
    from rcstat_vllm.compression import CompressionDecision, RequestCompressor
    from rcstat_vllm.config import RCStatConfig
    from rcstat_vllm.kv_layout import FLASH

    device = torch.device("cuda")
    extra = 5  # another request's query rows first in the step's query tensor
    rows, ok = [], True
    for method, window, smoothing in (("rc", 32, 3), ("rc", 8, 1), ("snapkv", 32, 1)):
        config = RCStatConfig(method=method, window=window, smoothing=smoothing)
        gen = torch.Generator().manual_seed(window)
        cache, _, table = flash_cache(n, torch.bfloat16, gen, device)
        query = torch.randn(extra + n, NUM_Q_HEADS, HEAD_DIM, generator=gen).to(device=device, dtype=torch.bfloat16)
        scores = {}
        original = compression.triton_device
        for path in ("triton", "torch"):
            if path == "torch":
                compression.triton_device = lambda tensor: False
            try:
                decision = CompressionDecision("r", config, n, extra, extra + n)
                request = RequestCompressor(decision, 1, table)
                request.observe_layer(0, query, cache, HEAD_DIM**-0.5, FLASH)
                scores[path] = request.scores[0].float()
            finally:
                compression.triton_device = original
        got, ref = scores["triton"], scores["torch"]
        finite = torch.isfinite(ref)
        same_inf = bool((torch.isinf(got) == torch.isinf(ref)).all())
        row = {"method": method, "window": window, "smoothing": smoothing, "n": n, "same_inf_positions": same_inf,
               **compare(torch.where(finite, got, torch.zeros_like(got)), torch.where(finite, ref, torch.zeros_like(ref)))}
        row["ok"] = same_inf and row["rel_err"] <= BF16_REL_TOL and row["top20_recall_min"] >= TOPK_RECALL_MIN
        ok = ok and row["ok"]
        rows.append(row)
    return {"ok": ok, "rows": rows}


def part_pytest(timeout: float) -> dict:
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {"ok": False, "skipped": "pytest is not installed on this machine"}
    files = ["tests/test_kernels.py", "tests/test_paged_scoring.py"]
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *files]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=gpu_common.REPO, capture_output=True, text=True, timeout=timeout)
        out, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, code = str(exc.stdout or "")[-3000:], "timeout"
    last = [line for line in out.splitlines() if line.strip()][-1:] or [""]
    return {"ok": code == 0, "returncode": code, "seconds": round(time.perf_counter() - t, 1), "summary": last[0],
            "note": "these tests set TRITON_INTERPRET=1 (CPU tensors); the GPU kernels are part 'kernels'",
            "output_tail": out[-3000:]}


def part_bench(sizes: list[int], repeats: int, timeout: float) -> dict:
    import torch

    name = f"scoring_{device_tag(torch.cuda.get_device_name(0))}"
    path = gpu_common.RESULTS / f"{name}.json"
    cmd = [sys.executable, "benchmarks/scoring.py", "--device", "cuda", "--sizes", ",".join(map(str, sizes)),
           "--repeats", str(repeats), "--json", str(path)]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=gpu_common.REPO, capture_output=True, text=True, timeout=timeout)
        out, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, code = str(exc.stdout or "")[-3000:], "timeout"
    result = {"ok": code == 0 and path.exists(), "returncode": code, "seconds": round(time.perf_counter() - t, 1),
              "output_tail": out[-3000:], "file": path.name}
    if path.exists() and os.environ.get("OUT"):
        shutil.copyfile(path, Path(os.environ["OUT"]) / path.name)
    return result


def device_tag(name: str) -> str:
    for tag in ("H100", "H200", "A100", "L40S", "B200"):
        if tag in name.upper():
            return tag.lower()
    return "cuda"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="kernels,live_path,pytest,bench")
    parser.add_argument("--sizes", default="4096,16384,32768", help="prompt lengths of part 'kernels'")
    parser.add_argument("--bench-sizes", default="4096,16384,65536")
    parser.add_argument("--bench-repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds for each subprocess part")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    report = {"check": "kernels", "environment": gpu_common.environment(), "parts": {}}
    sizes = [int(s) for s in args.sizes.split(",") if s]
    for part in args.parts.split(","):
        print(f"[kernels] part {part} ...", file=sys.stderr, flush=True)
        try:
            if part == "kernels":
                report["parts"][part] = part_kernels(sizes)
            elif part == "live_path":
                report["parts"][part] = part_live_path()
            elif part == "pytest":
                report["parts"][part] = part_pytest(args.timeout)
            elif part == "bench":
                report["parts"][part] = part_bench([int(s) for s in args.bench_sizes.split(",")], args.bench_repeats,
                                                   args.timeout)
            else:
                report["parts"][part] = {"ok": False, "error": "unknown part"}
        except BaseException as exc:  # noqa: BLE001 - next part
            report["parts"][part] = gpu_common.failure(exc)
        gpu_common.write_result("kernels", report)
    report["ok"] = all(p.get("ok") for p in report["parts"].values())
    worst = {}
    for row in report["parts"].get("kernels", {}).get("rows", []):
        key = f"{row['method']}/{row['dtype']}"
        worst[key] = max(worst.get(key, 0.0), row["rel_err"])
    report["headline"] = ", ".join(f"{p} {'ok' if r.get('ok') else 'FAIL'}" for p, r in report["parts"].items()) + (
        "; worst rel err " + json.dumps({k: f"{v:.1e}" for k, v in worst.items()}) if worst else "")
    missing = sorted({r.get("missing_module") for r in report["parts"].values() if r.get("missing_module")})
    if missing:
        report["missing_modules"] = missing
    report["seconds"] = round(time.perf_counter() - t0, 1)
    gpu_common.write_result("kernels", report)
    print(report["headline"])
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except BaseException as exc:  # noqa: BLE001 - whatever happens, a JSON file saying what
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        gpu_common.write_result("kernels", {"check": "kernels", **gpu_common.failure(exc)})
        raise
    sys.exit(code)
