"""With the flag, workers build vLLM's V1 model runner (the one the plugin hooks) and refuse to start otherwise.

vLLM 0.32 builds Model Runner V2 by default where Triton has a backend (CUDA); the CPU wheel here falls back to
V1 because Triton has no CPU backend. These tests make vLLM's own choice answer V2 (as on a GPU) by patching
what it reads, and check the plugin's choice, its start-up errors and the worker's runner check.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import vllm.config.vllm as vllm_config_module
from vllm import envs
from vllm.config.vllm import VllmConfig
from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CPUModelRunnerV2
from vllm.v1.worker.cpu_model_runner import CPUModelRunner as CPUModelRunnerV1
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from rcstat_vllm import plugin
from rcstat_vllm.patches import runner_choice
from rcstat_vllm.patches._contract import is_wrapped
from rcstat_vllm.patches.runner_choice import UnhookedRunnerError, check_runner

plugin.register()

FLAG = {"rcstat": {}}


def _set_v2_env(monkeypatch, value: bool | None) -> None:
    """``VLLM_USE_V2_MODEL_RUNNER`` as vLLM reads it. Set on ``vllm.envs`` itself: once an engine has started in this
    process vLLM caches its environment reads, so changing os.environ would not be seen."""
    monkeypatch.setattr(envs, "VLLM_USE_V2_MODEL_RUNNER", value, raising=False)


@pytest.fixture
def v2_by_default(monkeypatch):
    """vLLM's default choice as on a CUDA machine: Triton present, no unsupported feature, no env override."""
    _set_v2_env(monkeypatch, None)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    monkeypatch.setattr(VllmConfig, "_get_v2_model_runner_unsupported_features", lambda self: [])


def test_without_the_flag_vllm_chooses_v2(v2_by_default):
    assert VllmConfig().use_v2_model_runner is True


def test_with_the_flag_v1_is_chosen(v2_by_default):
    assert VllmConfig(additional_config=FLAG).use_v2_model_runner is False


def test_explicit_v2_request_fails_at_start_up_naming_the_variable(v2_by_default, monkeypatch):
    _set_v2_env(monkeypatch, True)
    assert VllmConfig().use_v2_model_runner is True  # without the flag: vLLM's own answer
    # The platform's config hook asks while vLLM builds the config: the engine never starts.
    with pytest.raises(UnhookedRunnerError, match="VLLM_USE_V2_MODEL_RUNNER=1"):
        VllmConfig(additional_config=FLAG)


def test_feature_that_needs_v2_fails_at_start_up(v2_by_default):
    config = VllmConfig(additional_config=FLAG)
    config.watermark_config = object()  # vLLM: "Watermarking requires Model Runner V2"
    with pytest.raises(UnhookedRunnerError, match="watermarking"):
        runner_choice.check_runner_choice(config)


def test_explicit_v1_request_is_kept(monkeypatch):
    _set_v2_env(monkeypatch, False)
    assert VllmConfig(additional_config=FLAG).use_v2_model_runner is False


def _runner(cls):
    return object.__new__(cls)  # the check reads the class only: no model, no device


@pytest.mark.parametrize("runner_cls", [GPUModelRunnerV2, CPUModelRunnerV2])
def test_worker_refuses_a_v2_runner_naming_its_class(runner_cls):
    config = VllmConfig(additional_config=FLAG)
    with pytest.raises(UnhookedRunnerError, match=f"{runner_cls.__module__}.{runner_cls.__qualname__}"):
        check_runner(config, _runner(runner_cls))
    check_runner(VllmConfig(), _runner(runner_cls))  # no flag: vLLM's business


def test_worker_accepts_the_hooked_v1_runners():
    config = VllmConfig(additional_config=FLAG)
    check_runner(config, _runner(GPUModelRunner))
    check_runner(config, _runner(CPUModelRunnerV1))  # overrides initialize_kv_cache and calls super()


def test_worker_refuses_a_v1_runner_whose_hook_is_missing(monkeypatch):
    original = GPUModelRunner.__dict__["execute_model"].__wrapped__
    monkeypatch.setattr(GPUModelRunner, "execute_model", original)
    with pytest.raises(UnhookedRunnerError, match="execute_model"):
        check_runner(VllmConfig(additional_config=FLAG), _runner(CPUModelRunnerV1))


def test_init_device_hooks_check_the_runner_built():
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    # Installed on both workers (the CPU worker overrides init_device)...
    assert is_wrapped(Worker.__dict__["init_device"])
    assert is_wrapped(CPUWorker.__dict__["init_device"])
    # ...and the hook checks what the original built.
    built = []

    def init_device(self):
        self.model_runner = _runner(CPUModelRunnerV2)
        built.append(self.model_runner)

    worker = SimpleNamespace(vllm_config=VllmConfig(additional_config=FLAG), model_runner=None)
    with pytest.raises(UnhookedRunnerError, match=r"cpu\.model_runner\.CPUModelRunner"):
        runner_choice._init_device(init_device)(worker)
    assert built
