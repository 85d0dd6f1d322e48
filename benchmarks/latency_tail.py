"""What the slowest inter-token gaps of a ``vllm bench serve`` run waited for, from the per-request times vLLM's
benchmark keeps with ``--save-detailed`` (``start_times``, ``ttfts``, ``itls``). Standard library only: the CPU
serving benchmark (benchmarks/serving.py) and the GPU window's (tools/gpu/check_serving.py) both read it."""

from __future__ import annotations

import math
import statistics


def tail_count(total: int, share: float) -> int:
    """How many of ``total`` samples the slowest ``share`` is: at least 5 (a tail of a short run is still read)."""
    return max(5, math.ceil(share * total))


def itl_tail(start_times: list[float], ttfts: list[float], itls: list[list[float]], share: float = 0.01) -> dict:
    """What the slowest ``share`` of the inter-token gaps (at least 5) were waiting for. Each as ``[ms, seconds into
    the run, ms from its end to the nearest other request's first token]`` (negative: inside the gap), slowest first,
    and how many of them had another request's first token inside them or within half a median gap after (the same
    step's outputs reach the clients one after another): a step that prefilled a prompt beside this request's
    decoding. With chunked prefill a prompt's earlier chunks produce no token and are not counted: a lower bound.
    Times in seconds, as vLLM's benchmark records them."""
    first_tokens = [start + ttft if ttft else None for start, ttft in zip(start_times, ttfts)]
    gaps = []  # (duration, end, request)
    for request, (start, ttft, gaps_of) in enumerate(zip(start_times, ttfts, itls)):
        end = start + (ttft or 0.0)
        for gap in gaps_of or []:
            end += gap
            gaps.append((gap, end, request))
    if not gaps:
        return {}
    t0, slack = min(start_times), statistics.median(gap for gap, _, _ in gaps) / 2
    count = tail_count(len(gaps), share)
    slowest, beside = [], 0
    for gap, end, request in sorted(gaps, reverse=True)[:count]:
        offsets = [t - end for i, t in enumerate(first_tokens) if i != request and t is not None]
        nearest = min(offsets, key=abs) if offsets else None
        beside += any(-gap < offset <= slack for offset in offsets)
        slowest.append(
            [round(1000 * gap, 1), round(end - t0, 2), None if nearest is None else round(1000 * nearest, 1)]
        )
    return {"gaps": len(gaps), "slowest": slowest, "slowest_beside_a_prefill": beside}
