"""Start-up guards of the CUDA backend: every assumption head-as-sequence makes on a GPU is checked when vLLM builds
the metadata builder; an engine that breaks one runs uncompressed with the reason, never failing mid-forward.

vLLM's CUDA build cannot run here: the configuration objects are the fields the guards read, and FlashAttention's
version choice (a CUDA-build function) is set per test.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import vllm.v1.attention.backends.fa_utils as fa_utils
from fake_vllm import fake_vllm_config

from rcstat_vllm.attention.cuda_backend import SUPPORTED_FA_VERSIONS, unsupported_reason


def _config(block_size=16):
    return SimpleNamespace(
        cache_config=SimpleNamespace(kv_cache_layout=None, cache_dtype="auto", block_size=block_size),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
    )


def _spec(block_size=16, head_size=128):
    return SimpleNamespace(block_size=block_size, head_size=head_size, head_size_v=head_size)


@pytest.fixture
def fa_version(monkeypatch):
    """Set the FlashAttention version vLLM would pick; records what it was asked."""
    asked = []

    def choose(version):
        def get_flash_attn_version(**kwargs):
            asked.append(kwargs)
            return version

        monkeypatch.setattr(fa_utils, "get_flash_attn_version", get_flash_attn_version)

    choose.asked = asked
    return choose


@pytest.mark.parametrize("version", SUPPORTED_FA_VERSIONS)
def test_supported_engine_has_no_reason(fa_version, version):
    fa_version(version)
    assert unsupported_reason(_config(), ["attn"], _spec()) is None
    # Asked as vLLM's FlashAttention builder asks: the spec's head size and block size.
    assert fa_version.asked[-1] == {
        "head_size": 128,
        "head_size_v": 128,
        "kv_cache_block_size": 16,
        "supports_fa4_hd256": True,
    }


def test_kernel_block_size_split_from_the_scheduler_block_is_refused(fa_version):
    fa_version(3)
    # vLLM hands the builder a spec with the kernel block size when it splits blocks (e.g. 64-token kernel blocks
    # of 256-token scheduler blocks); head pages are slices of the scheduler's blocks.
    reason = unsupported_reason(_config(block_size=256), ["attn"], _spec(block_size=64))
    assert "kernel's block size (64 tokens)" in reason and "scheduler's (256)" in reason


@pytest.mark.parametrize("version", [4, None])
def test_flash_attention_versions_without_the_paged_varlen_call_are_refused(fa_version, version):
    fa_version(version)
    reason = unsupported_reason(_config(), ["attn"], _spec(head_size=256))
    assert f"FlashAttention version {version} (head size 256)" in reason


def test_builder_disables_compression_with_the_reason(fa_version, monkeypatch):
    """The builder's constructor passes its spec to the guard and disables the worker's compression with the reason
    (logged once); requests then run vLLM's FlashAttention path."""
    from rcstat_vllm.attention import cuda_backend as backend_cuda

    fa_version(4)
    disabled = []
    owner = SimpleNamespace(attach_layers=lambda *a, **k: True, disable=disabled.append)
    monkeypatch.setattr(backend_cuda, "worker_compression", lambda vllm_config: owner)
    monkeypatch.setattr(backend_cuda.FlashAttentionMetadataBuilder, "__init__", lambda self, *args: None)
    spec = SimpleNamespace(num_kv_heads=2, **vars(_spec(head_size=256)))
    backend_cuda.RCStatFlashMetadataBuilder(spec, ["attn"], _config(), "cuda")
    assert len(disabled) == 1 and "FlashAttention version 4" in disabled[0]


def test_cache_tensors_without_a_head_page_view_disable_compression_when_bound():
    """The stride assumptions of the head-page view are checked when the caches are bound (start-up)."""
    import torch

    from rcstat_vllm.paging.kv_layout import FLASH
    from rcstat_vllm.worker.driver import WorkerCompression

    def worker(cache):
        config = fake_vllm_config({}, 16)
        owner = WorkerCompression(config)
        owner.attach_layers(["attn"], num_kv_heads=2, block_size=16, layout=FLASH)
        owner.bind_kv_caches({"attn": cache})
        return owner

    assert worker(torch.zeros(4, 2, 16, 64)).disabled_reason is None  # head-major blocks (LBHNC)
    token_major = torch.zeros(4, 16, 2, 64).transpose(1, 2)  # LBNHC: a block's heads interleaved per token
    assert "not head-major" in worker(token_major).disabled_reason
    channel_split = torch.zeros(4, 2, 64, 16).transpose(2, 3)  # each row's channels strided
    assert "row contiguous" in worker(channel_split).disabled_reason
