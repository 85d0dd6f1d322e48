"""The GPU windows' settings, checked here before a window spends minutes on them (issues 51, 53): every rcstat
section the GPU plans run is a valid plugin config meaning what its row says, and every engine configuration
tools/gpu/throughput.py builds is one vLLM's ``LLM(...)`` accepts as given (no key dropped on the way to EngineArgs:
``LLM`` keeps only a config dict's known fields, so a misspelt graph option would silently measure vLLM's default)."""

from __future__ import annotations

import dataclasses

import pytest
from gpu_tools import load

from rcstat_vllm.config import server_config

common = load("gpu_common")
throughput = load("throughput")
serving = load("check_serving")
plan = load("window_plan")


@pytest.mark.parametrize("settings", [common.SETTINGS, serving.SETTINGS], ids=["throughput", "serving"])
def test_every_rcstat_section_is_a_valid_config(settings):
    for name, (env, rcstat) in settings.items():
        config = server_config(None if rcstat is None else {"rcstat": rcstat})
        assert (config is None) == (rcstat is None), name
        assert (env.get("VLLM_PLUGINS") == "__none__") <= (rcstat is None), f"{name}: a flag without the plugin"
        if config is None:
            continue
        assert config.async_scheduling == ("keep" if name.endswith("-async") else "off"), name
        assert config.cuda_graphs == ("full_decode" if name.endswith("-graphs") else "piecewise"), name
        if "rc0.8" in name:
            assert (config.method, config.target_ratio) == ("rc", 0.8), name


def test_every_defaults_row_is_a_known_setting():
    assert set(plan.DEFAULTS_ROWS) <= set(common.SETTINGS)


@pytest.mark.parametrize("mode", ["graphs", "eager"])
def test_every_engine_configuration_reaches_vllm_whole(mode, tmp_path):
    pytest.importorskip("vllm")
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    init_fields = {f.name for f in dataclasses.fields(CompilationConfig) if f.init}
    for setting in common.SETTINGS:
        if mode == "eager" and setting in common.ENGINE_EXTRA:
            continue  # (refused by throughput.py: graph options need --mode graphs)
        kwargs = throughput.engine_for(setting, mode, tmp_path, 8704, 1 << 30, 16)
        compilation = kwargs.pop("compilation_config", {})
        assert set(compilation) <= init_fields, f"{setting}: LLM() would drop {set(compilation) - init_fields}"
        args = EngineArgs(**kwargs, compilation_config=CompilationConfig(**compilation))
        if mode == "eager":
            assert args.enforce_eager and args.compilation_config.mode == CompilationMode.NONE, setting
            continue
        assert not args.enforce_eager and args.max_num_seqs == 16, setting
        if setting == "vanilla-piecewise":  # what the plugin changes at vLLM's defaults, on vanilla
            assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE and args.async_scheduling is False
        else:  # vLLM's defaults: the graph mode and async scheduling are left to vLLM (and the plugin)
            assert args.compilation_config.cudagraph_mode is None and args.async_scheduling is None, setting
