"""Engines the plugin's CUDA backend cannot serve fall back to the backend vLLM would have chosen, uncompressed,
with one start-up line naming the reason (issue 23).

vLLM's CUDA build cannot run here: the platform is a class answering a compute capability, the engine config the
fields the hook and vLLM's FlashAttention check read (as tests/test_cuda_guards.py fakes them), and the hook is the
platform's ``check_and_update_config`` wrapper itself, around a stand-in for vLLM's own.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from rcstat_vllm.attention.cuda_backend import (
    RCStatFlashBackend,
    cuda_backend_unsupported_reason,
)
from rcstat_vllm.patches import platform
from rcstat_vllm.vllm_private.internals import backend_invalid_reasons
from rcstat_vllm.worker.driver import new_worker_compression
from rcstat_vllm.worker.step import BatchRequest, StepInfo

SM75, SM80, SM90 = DeviceCapability(7, 5), DeviceCapability(8, 0), DeviceCapability(9, 0)


def _engine(
    dtype=torch.bfloat16,
    use_mla=False,
    head_size=128,
    model_type="llama",
    backend=None,
    cache_dtype="auto",
    hf=None,
    parallel=None,
    context=None,
):
    """The engine config fields the hook, vLLM's FlashAttention check and the worker read."""
    return SimpleNamespace(
        additional_config={"rcstat": {}},
        attention_config=SimpleNamespace(backend=backend, use_non_causal=False),
        model_config=SimpleNamespace(
            dtype=dtype,
            use_mla=use_mla,
            get_head_size=lambda: head_size,
            is_mm_prefix_lm=False,
            rswa_window=None,
            hf_text_config=SimpleNamespace(model_type=model_type, **(hf or {})),
        ),
        cache_config=SimpleNamespace(
            kv_cache_layout=None,
            cache_dtype=cache_dtype,
            block_size=16,
            user_specified_block_size=False,
            kv_offloading_size=None,
        ),
        parallel_config=SimpleNamespace(
            **{
                "tensor_parallel_size": 1,
                "pipeline_parallel_size": 1,
                "decode_context_parallel_size": 1,
                "prefill_context_parallel_size": 1,
                "use_ubatching": False,
                **(parallel or {}),
            }
        ),
        speculative_config=None,
        kv_transfer_config=None,
        compilation_config=SimpleNamespace(static_forward_context=context or {}),
    )


#: (engine, GPU, words the start-up line names)
UNSERVED = {
    "mla": (dict(use_mla=True, head_size=576), SM90, "MLA"),
    "float32": (dict(dtype=torch.float32), SM90, "float32"),
    "sm75": (dict(), SM75, "compute capability 7.5"),
    "sinks-sm80": (dict(model_type="gpt_oss", head_size=64), SM80, "sinks"),
    "fp8-kv-cache": (dict(cache_dtype="fp8"), SM90, "quantized KV cache"),
    "dbo": (dict(parallel=dict(use_ubatching=True)), SM90, "micro-batching"),
}


class _Platform:
    """A CUDA platform class as far as the hook reads it: the GPU's compute capability."""

    capability: DeviceCapability | None = SM90
    asked = 0

    @classmethod
    def get_device_capability(cls, device_id: int = 0):
        cls.asked += 1
        return cls.capability


@pytest.fixture
def hook(monkeypatch):
    """The CUDA config hook around a stand-in for vLLM's own: returns the backend vLLM's check saw and whether the
    engine was configured with compression off."""
    configured = []
    monkeypatch.setattr(platform, "_configure_engine", lambda config, rcstat, off=False: configured.append(off))
    _Platform.asked = 0

    def run(config, capability=SM90):
        seen = []
        _Platform.capability = capability
        wrapper = platform._check_and_update_config(
            lambda cls, vllm_config: seen.append(vllm_config.attention_config.backend), select_backend=True
        )
        wrapper(_Platform, config)
        return seen[0], configured[-1]

    return run


def _rcstat_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "rcstat" in r.getMessage()]


@pytest.mark.parametrize("case", UNSERVED, ids=list(UNSERVED))
def test_an_engine_the_backend_cannot_serve_gets_vllms_choice_and_one_line_naming_why(case, hook, caplog):
    engine, capability, words = UNSERVED[case]
    config = _engine(**engine)
    backend, compression_off = hook(config, capability)
    assert backend is None and config.attention_config.backend is None  # vLLM chooses as without the plugin
    assert compression_off
    (line,) = _rcstat_warnings(caplog)
    assert words in line and "KV compression is off, requests run uncompressed" in line
    assert line.startswith("rcstat: ")


def test_a_supported_engine_selects_the_plugins_backend(hook, caplog):
    config = _engine()  # bf16, head size 128, sm90
    assert cuda_backend_unsupported_reason(config, SM90) is None
    backend, compression_off = hook(config, SM90)
    assert backend is AttentionBackendEnum.CUSTOM and not compression_off
    assert _rcstat_warnings(caplog) == []


@pytest.mark.parametrize("explicit", [AttentionBackendEnum.FLASHINFER, AttentionBackendEnum.CUSTOM])
def test_an_explicit_attention_backend_is_kept_as_the_user_asked(explicit, hook):
    config = _engine(use_mla=True, head_size=576, backend=explicit)
    backend, compression_off = hook(config, SM75)
    assert backend is explicit and config.attention_config.backend is explicit
    assert _Platform.asked == 0  # nothing the plugin would decide
    assert compression_off is (explicit is not AttentionBackendEnum.CUSTOM)


@pytest.mark.parametrize("case", [c for c in UNSERVED if c not in ("fp8-kv-cache", "dbo")])
def test_vllm_itself_refuses_the_plugins_backend_for_these_engines(case):
    """Why the fallback is needed: vLLM's own check of the selected backend (which, failing, stops the engine with
    "Selected backend ... is not valid") rejects the plugin's FlashAttention subclass for these engines."""
    engine, capability, _ = UNSERVED[case]
    config = _engine(**engine)
    has_sink = case.startswith("sinks")
    assert backend_invalid_reasons(RCStatFlashBackend, config, capability, has_sink=has_sink) != []
    assert backend_invalid_reasons(RCStatFlashBackend, _engine(), SM90, has_sink=False) == []


def test_sinks_are_read_from_the_config_as_vllms_model_code_reads_them():
    def reason(model_type, capability=SM90, **hf):
        return cuda_backend_unsupported_reason(_engine(model_type=model_type, hf=hf), capability)

    assert "sinks" in reason("gpt_oss")  # every layer, on any GPU: head-as-sequence passes no sinks
    assert "sinks" in reason("granite", layer_types=["sliding_attention", "full_attention"])
    assert reason("granite", layer_types=["full_attention"], attention_sinks=False) is None
    assert reason("granite") is None
    assert "sinks" in reason("mimo_v2", add_swa_attention_sink_bias=True)
    assert "sinks" in reason("laguna", swa_attention_sink_enabled=True)
    assert reason("llama") is None


def test_unknown_capability_still_answers_what_the_config_says():
    assert "MLA" in cuda_backend_unsupported_reason(_engine(use_mla=True, head_size=576), None)
    assert cuda_backend_unsupported_reason(_engine(), None) is None


class TritonAttentionImpl:  # named as vLLM's: what the worker's reason names
    pass


def test_the_worker_of_a_fallen_back_engine_reports_every_request_uncompressed(caplog):
    """No layer runs the plugin's backend, so no builder of it plans the steps: the worker says so (information, the
    start-up warning was the platform's) and reports each request uncompressed, as the builder's plan would."""
    context = {"model.layers.0.self_attn.attn": SimpleNamespace(impl=TritonAttentionImpl())}
    config = _engine(use_mla=True, head_size=576, context=context)
    owner = new_worker_compression(config)
    owner.bind_kv_caches({})  # the runner hook, once vLLM bound its caches; no builder attached a layer
    assert "vLLM's own attention backend serves every layer (TritonAttentionImpl)" in owner.disabled_reason
    assert _rcstat_warnings(caplog) == []

    owner.begin_step(StepInfo(requests=[BatchRequest("long", 300, 0, 256), BatchRequest("short", 40, 0, 40)]))
    assert [r.req_id for r in owner.pop_reports()] == ["short"]  # "long" is still in prefill
    owner.begin_step(StepInfo(requests=[BatchRequest("long", 300, 256, 44), BatchRequest("short", 40, 40, 1)]))
    (report,) = owner.pop_reports()
    assert report.req_id == "long" and report.skipped_reason == owner.disabled_reason
    results = owner.compression_results()
    assert set(results) == {"long", "short"}
    for result in results.values():
        assert result["skipped_reason"] == owner.disabled_reason
        assert result["compression_ratio"] == 0.0 and result["blocks_freed"] == 0
    assert results["long"]["keep_blocks"] == 300 // 16 + 1  # every prompt block kept


@pytest.mark.parametrize(("setting", "kept"), [("off", False), ("keep", True)])
def test_asynchronous_scheduling_is_turned_off_unless_the_flag_keeps_it(monkeypatch, setting, kept):
    """vLLM turns asynchronous scheduling on by default on GPUs; the plugin turns it off (``async_scheduling: off``,
    the default until a GPU window has measured ``keep``) or leaves it as vLLM set it."""
    from rcstat_vllm.config import RCStatConfig
    from rcstat_vllm.patches import runner_choice

    monkeypatch.setattr(runner_choice, "check_runner_choice", lambda vllm_config: None)
    monkeypatch.setattr(platform, "_AT_CONFIGURE", [])
    vllm_config = SimpleNamespace(
        scheduler_config=SimpleNamespace(async_scheduling=True),
        parallel_config=SimpleNamespace(worker_extension_cls=""),
    )
    platform._configure_engine(vllm_config, RCStatConfig(async_scheduling=setting))
    assert vllm_config.scheduler_config.async_scheduling is kept
