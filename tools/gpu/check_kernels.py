#!/usr/bin/env python3
"""Check 4: the Triton RC and SnapKV paged scoring kernels on the GPU against their references, and on the live path.

Parts (each recorded separately in kernels.json; a failure in one does not stop the next):

1. ``kernels``: the correctness and host-sync parts of ``benchmarks/gpu_check.py`` (which also runs without vLLM, see
   ``benchmarks/gpu_check.sh``): both kernels against float64 references on the same rounded inputs at the shapes of
   Llama-3.1-8B, Qwen2.5-7B, SmolLM2 and a head size of 256, bf16 / fp16 / fp32, RC's default and the paper's
   settings, SnapKV's; the whole default scorer; no host synchronisation in either paged scorer (41 checks). Then
   decode time: RC's head-page kernel at the same shapes, dtypes and RC settings (24 checks) and the default scorer's
   ``score_head_pages`` (1), 66 in all; no host synchronisation in RC's decode-time scoring.
2. ``live_path``: ``RequestCompressor.observe_layer`` (what the CUDA backend calls per layer) with the Triton kernels
   against the same call forced onto the torch path, bf16 cache in vLLM's CUDA layout on the GPU.
3. ``decode_speed``: decode-time scoring timed, one layer at Llama-3.1-8B shapes in bf16 (``gpu_check.decode_speed``):
   the default RC scorer's head-page kernel against the torch path it replaces, heads of up to 4k, 16k, 32k entries.
4. ``pytest``: tests/test_kernels.py compiled (``TRITON_INTERPRET=0``: CUDA tensors, the bf16 cases included).
5. ``bench``: benchmarks/scoring.py --device cuda (timings; written as scoring_<device>.json).

    python tools/gpu/check_kernels.py                 # all parts, writes kernels.json
    python tools/gpu/check_kernels.py --parts kernels,live_path --sizes 4096,16384
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import gpu_common

sys.path.insert(0, str(gpu_common.REPO / "benchmarks"))
import gpu_check

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
#: Triton against torch on the same bf16 values: only the float32 summation order differs.
LIVE_PATH_REL_TOL = 1e-3


def flash_cache(n: int, dtype, gen, device):
    """A vLLM-CUDA-layout cache [B, H, N, 2D] with a spare page, scrambled block table; returns (key view, table)."""
    import torch

    pages = -(-n // PAGE) + 1
    num_blocks = pages + 7
    cache = torch.randn(num_blocks, NUM_KV_HEADS, PAGE, 2 * HEAD_DIM, generator=gen).to(device=device, dtype=dtype)
    table = torch.randperm(num_blocks, generator=gen)[:pages].to(device=device, dtype=torch.int32)
    return cache, cache[..., :HEAD_DIM], table


def progress(what: str) -> None:
    print(f"[kernels] {what}", file=sys.stderr, flush=True)


def part_kernels(sizes: list[int]) -> dict:
    """gpu_check's correctness part: every shape and dtype at the first size, Llama-3.1-8B bf16 at the others."""
    import torch

    device = torch.device("cuda")
    checks = gpu_check.kernel_checks(device, sizes[:1], list(gpu_check.SHAPES), list(gpu_check.DTYPES), PAGE, progress)
    checks += gpu_check.kernel_checks(device, sizes[1:], ["llama3.1-8b"], ["bf16"], PAGE, progress)
    checks += gpu_check.scorer_check(device, 16381, PAGE, "bf16", progress)
    # Decode time: RC's head-page kernel at every shape and dtype, and the default scorer's score_head_pages.
    checks += gpu_check.decode_checks(
        device, gpu_check.DECODE_N, list(gpu_check.SHAPES), list(gpu_check.DTYPES), PAGE, progress
    )
    checks += gpu_check.decode_scorer_check(device, gpu_check.DECODE_N, PAGE, "bf16", progress)
    syncs = gpu_check.sync_check(device, 16381, PAGE)
    return {
        "ok": all(c.passed for c in checks) and set(syncs.values()) == {"none"},
        "tolerances": gpu_check.TOLERANCE,
        "host_syncs": syncs,
        "rows": [asdict(c) for c in checks],
    }


def part_live_path(n: int = 8192) -> dict:
    """observe_layer as the CUDA backend runs it (Triton) vs the same call on the torch path, bf16 on the GPU."""
    import torch

    import rcstat_vllm.worker.prompt_compression as compression
    from rcstat_vllm.config import RCStatConfig
    from rcstat_vllm.paging.kv_layout import FLASH
    from rcstat_vllm.worker.prompt_compression import CompressionDecision, RequestCompressor

    device = torch.device("cuda")
    extra = 5  # another request's query rows first in the step's query tensor
    rows = []
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
        check = gpu_check.compare(
            f"{method} w={window} smoothing={smoothing} n={n}", scores["triton"], scores["torch"], LIVE_PATH_REL_TOL
        )
        rows.append(asdict(check))
    return {"ok": all(row["passed"] for row in rows), "rows": rows}


def part_decode_speed(sizes: list[int]) -> dict:
    """Decode-time RC scoring timed on the GPU: the head-page kernel and the torch path, one layer, bf16."""
    import torch

    rows = gpu_check.decode_speed(torch.device("cuda"), sizes, PAGE, progress, "bf16")
    return {"ok": all(r["kernel_ms_median"] > 0 and r["torch_ms_median"] > 0 for r in rows), "rows": rows}


def part_pytest(timeout: float) -> dict:
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {"ok": False, "skipped": "pytest is not installed on this machine"}
    # -P: the checkout's own rcstat_vllm/ (no kernels/ inside) must not shadow the installed plugin.
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "tests/test_kernels.py"]
    t = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd,
            cwd=gpu_common.REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "TRITON_INTERPRET": "0"},
        )
        out, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, code = str(exc.stdout or "")[-3000:], "timeout"
    last = [line for line in out.splitlines() if line.strip()][-1:] or [""]
    return {
        "ok": code == 0,
        "returncode": code,
        "seconds": round(time.perf_counter() - t, 1),
        "summary": last[0],
        "note": "compiled (TRITON_INTERPRET=0): the kernels on CUDA tensors, bf16 included",
        "output_tail": out[-3000:],
    }


def part_bench(sizes: list[int], repeats: int, timeout: float) -> dict:
    import torch

    name = f"scoring_{device_tag(torch.cuda.get_device_name(0))}"
    path = gpu_common.RESULTS / f"{name}.json"
    cmd = [
        sys.executable,
        "benchmarks/scoring.py",
        "--device",
        "cuda",
        "--sizes",
        ",".join(map(str, sizes)),
        "--repeats",
        str(repeats),
        "--json",
        str(path),
    ]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=gpu_common.REPO, capture_output=True, text=True, timeout=timeout)
        out, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, code = str(exc.stdout or "")[-3000:], "timeout"
    result = {
        "ok": code == 0 and path.exists(),
        "returncode": code,
        "seconds": round(time.perf_counter() - t, 1),
        "output_tail": out[-3000:],
        "file": path.name,
    }
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
    parser.add_argument("--parts", default="kernels,live_path,decode_speed,pytest,bench")
    parser.add_argument(
        "--decode-sizes", default=",".join(map(str, gpu_check.DECODE_SPEED_NS)), help="part decode_speed's n"
    )
    parser.add_argument(
        "--sizes", default="8191,32771", help="prompt lengths of part 'kernels' (all shapes at the first)"
    )
    parser.add_argument("--bench-sizes", default="4096,16384,65536")
    parser.add_argument("--bench-repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds for each subprocess part")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    report = {"check": "kernels", "environment": gpu_common.environment(), "parts": {}}
    sizes = [int(s) for s in args.sizes.split(",") if s]
    dry = bool(os.environ.get("RCSTAT_DRY_RUN"))
    if dry:  # tools/gpu/window.sh dry: the imports above ran (torch, Triton, the kernels); no CUDA to launch them on
        import rcstat_vllm.kernels.decode_scoring
        import rcstat_vllm.worker.prompt_compression  # noqa: F401

        report["dry_run"] = True
    for part in args.parts.split(","):
        print(f"[kernels] part {part} ...", file=sys.stderr, flush=True)
        try:
            if dry and part in ("kernels", "live_path", "decode_speed", "pytest", "bench"):
                report["parts"][part] = {"ok": False, "dry_run": True, "skipped": "dry run: needs CUDA"}
            elif part == "kernels":
                report["parts"][part] = part_kernels(sizes)
            elif part == "live_path":
                report["parts"][part] = part_live_path()
            elif part == "decode_speed":
                report["parts"][part] = part_decode_speed([int(s) for s in args.decode_sizes.split(",") if s])
            elif part == "pytest":
                report["parts"][part] = part_pytest(args.timeout)
            elif part == "bench":
                report["parts"][part] = part_bench(
                    [int(s) for s in args.bench_sizes.split(",")], args.bench_repeats, args.timeout
                )
            else:
                report["parts"][part] = {"ok": False, "error": "unknown part"}
        except BaseException as exc:  # noqa: BLE001 - next part
            report["parts"][part] = gpu_common.failure(exc)
        gpu_common.write_result("kernels", report)
    report["ok"] = all(p.get("ok") for p in report["parts"].values())
    worst = max((row["rel_l2"] for row in report["parts"].get("kernels", {}).get("rows", [])), default=None)
    verdict = {True: "ok", False: "FAIL"}
    report["headline"] = ", ".join(
        f"{p} {'dry' if r.get('dry_run') else verdict[bool(r.get('ok'))]}" for p, r in report["parts"].items()
    ) + (f"; worst relative L2 error {worst:.1e}" if worst is not None else "")
    missing = sorted({r.get("missing_module") for r in report["parts"].values() if r.get("missing_module")})
    if missing:
        report["missing_modules"] = missing
    report["seconds"] = round(time.perf_counter() - t0, 1)
    gpu_common.write_result("kernels", report)
    print(report["headline"])
    return 0


if __name__ == "__main__":
    gpu_common.run_main(main, "kernels", worker=False)
