"""What tensor-parallel ranks must agree on before a plan reaches the scheduler.

The ranks of a tensor-parallel group hold different KV heads of the same requests but share one block table (the
scheduler's): every rank must keep the same number of blocks per request (the most any rank's heads need), and a
token counts as evicted (for the per-request report) only where every rank's heads evicted it. Each function is a
collective: every rank calls it in the same order with as many values (vLLM's TP ranks run the same steps).
"""

from __future__ import annotations

import torch
from torch import Tensor


def max_over_ranks(values: list[int], group) -> list[int]:
    """Element-wise max of ``values`` over the ranks of ``group`` (a torch.distributed process group; None:
    a single rank)."""
    if group is None:
        return values
    tensor = torch.tensor(values, dtype=torch.int64)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=group)
    return tensor.tolist()


def visible_on_any_rank(masks: list[Tensor], group) -> list[Tensor]:
    """Per request, the bool mask of tokens some rank's heads keep (an evicted token is evicted everywhere)."""
    if group is None:
        return masks
    flat = torch.cat([m.flatten() for m in masks]).to(torch.int64).tolist()
    merged = torch.tensor(max_over_ranks(flat, group), dtype=torch.bool)
    return [part.view_as(m) for part, m in zip(merged.split([m.numel() for m in masks]), masks)]
