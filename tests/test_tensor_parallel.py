"""Tensor-parallel ranks agree on the blocks a compressed request keeps (the max over ranks of what each
rank's heads need), through a real torch.distributed gloo group of two processes."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rcstat_vllm.paging.compaction import blocks_needed, compact_request
from rcstat_vllm.paging.page_space import PageSpace, cdiv
from rcstat_vllm.worker.rank_agreement import max_over_ranks

BLOCK, HEADS, DIM, N = 16, 2, 8, 100
#: rank 0's heads keep few tokens, rank 1's many: they need different block counts
KEEP_FRACTION = {0: 0.2, 1: 0.9}
SPACE = PageSpace.per_layer(1, HEADS, BLOCK)
#: the blocks the scheduler allocates for the compacted request (the prompt's are 1..7)
FRESH = torch.arange(10, 20)


def _selection(rank: int):
    g = torch.Generator().manual_seed(rank)
    kv = torch.randn(20, HEADS, BLOCK, 2 * DIM, generator=g)
    row = torch.arange(1, 1 + cdiv(N, BLOCK), dtype=torch.int32)
    keep = torch.rand(HEADS, N, generator=g) < KEEP_FRACTION[rank]
    keep[:, -8:] = True
    return kv, row, keep


def _rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        kv, row, keep = _selection(rank)
        needed = blocks_needed(keep.sum(1).unsqueeze(0), N, SPACE)
        (agreed,) = max_over_ranks([needed], dist.group.WORLD)
        state = compact_request([kv], row, [keep], FRESH[:agreed], SPACE)
        free_pages = [len(pool) for pool in state.pools]
        used = int((state.tables >= 0).sum())
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"needed": needed, "keep_blocks": state.keep_blocks, "free_pages": free_pages, "used": used}, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_keep_the_max_of_the_blocks_their_heads_need(tmp_path):
    out = str(tmp_path / "rank")
    mp.spawn(_rank, args=(_free_port(), out), nprocs=2, join=True)
    results = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    assert results[0]["needed"] < results[1]["needed"]  # the ranks really disagreed before agreeing
    agreed = results[1]["needed"]
    assert [r["keep_blocks"] for r in results] == [agreed, agreed]
    # Rank 0 keeps more blocks than its heads need: the extra pages wait in its pools for decode growth.
    assert results[0]["free_pages"] == [agreed * HEADS - results[0]["used"]]


def test_single_rank_is_its_own_agreement():
    assert max_over_ranks([3, 1, 4], None) == [3, 1, 4]


def test_compaction_refuses_fewer_blocks_than_the_kept_pages_need():
    kv, row, keep = _selection(1)
    pages = int(((keep.sum(1) + BLOCK - 1) // BLOCK).sum())
    with pytest.raises(ValueError, match="pages needed"):
        compact_request([kv], row, [keep], FRESH[: cdiv(pages, HEADS) - 1], SPACE)
