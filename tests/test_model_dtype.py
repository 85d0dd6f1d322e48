"""The dtype the project's own engines run the embedded model in (rcstat_vllm.model.embedded_model_dtype).

bf16 where the CPU computes it natively (AVX512-BF16 or AMX), float32 on other x86 CPUs (bf16 matmuls there are
~30x slower), the model's own dtype on a GPU; an explicit dtype, in engine kwargs or on the `serve` command
line, is never replaced.
"""

from __future__ import annotations

import pytest
import torch

from rcstat_vllm import cli, model


@pytest.fixture
def cpu(monkeypatch):
    """Fake the CPU: ``cpu(capability, avx512_bf16=False, amx=False, machine="x86_64")``."""

    def fake(capability: str, avx512_bf16: bool = False, amx: bool = False, machine: str = "x86_64"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr("platform.machine", lambda: machine)

    return fake


@pytest.mark.parametrize(
    "capability,avx512_bf16,amx,machine,expected",
    [
        ("AVX2", False, False, "x86_64", "float32"),  # Zen 1-3 EPYC: no AVX-512 at all
        ("AVX512", False, False, "x86_64", "float32"),  # Skylake-SP: AVX-512 without bf16 instructions
        ("AVX512", True, False, "x86_64", None),  # Cooper Lake, Zen 4
        ("AVX512", False, True, "x86_64", None),  # Sapphire Rapids (AMX)
        ("AVX2", True, True, "x86_64", "float32"),  # ATEN_CPU_CAPABILITY=avx2 imitating an AVX2-only CPU
        ("DEFAULT", False, False, "aarch64", None),  # not x86: keep the model's own dtype
    ],
)
def test_float32_exactly_where_bf16_is_not_native(cpu, capability, avx512_bf16, amx, machine, expected):
    cpu(capability, avx512_bf16, amx, machine)
    assert model.embedded_model_dtype() == expected


def test_gpu_keeps_the_models_dtype(cpu, monkeypatch):
    cpu("AVX2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert model.embedded_model_dtype() is None


def test_engine_kwargs_gain_a_dtype_only_when_none_was_given(cpu):
    cpu("AVX2")
    assert model.with_embedded_dtype({"model": "m"}) == {"model": "m", "dtype": "float32"}
    for chosen in ("bfloat16", "auto", "float16"):
        assert model.with_embedded_dtype({"model": "m", "dtype": chosen}) == {"model": "m", "dtype": chosen}
    cpu("AVX512", avx512_bf16=True)
    assert model.with_embedded_dtype({"model": "m"}) == {"model": "m"}


def test_a_kv_pool_sized_in_bytes_keeps_its_tokens_in_float32(cpu):
    """Pools are sized in bytes for bf16: in float32 the budget doubles, so the pool holds the same tokens."""
    cpu("AVX2")
    assert model.with_embedded_dtype({"kv_cache_memory_bytes": 100 << 20}) == {
        "kv_cache_memory_bytes": 200 << 20,
        "dtype": "float32",
    }
    assert model.with_embedded_dtype({"kv_cache_memory_bytes": 100 << 20, "dtype": "bfloat16"}) == {
        "kv_cache_memory_bytes": 100 << 20,
        "dtype": "bfloat16",
    }
    cpu("AVX512", avx512_bf16=True)
    assert model.with_embedded_dtype({"kv_cache_memory_bytes": 100 << 20}) == {"kv_cache_memory_bytes": 100 << 20}


def test_demo_and_benchmark_engines_use_it(cpu):
    from rcstat_vllm.demo import engine_kwargs

    cpu("AVX2")
    assert engine_kwargs("m", {})["dtype"] == "float32"
    cpu("AVX512", amx=True)
    assert "dtype" not in engine_kwargs("m", {})


def test_serve_adds_float32_for_the_embedded_model_only_without_a_dtype(cpu, monkeypatch, tmp_path, capsys):
    cpu("AVX2")
    embedded = tmp_path / "SmolLM2"
    monkeypatch.setattr(model, "default_model_dir", lambda: embedded)
    assert cli._embedded_model_dtype_args([str(embedded), "--port", "1"]) == [
        str(embedded),
        "--port",
        "1",
        "--dtype",
        "float32",
    ]
    assert "no native bf16" in capsys.readouterr().err
    for explicit in (["--dtype", "bfloat16"], ["--dtype=bfloat16"]):
        assert cli._embedded_model_dtype_args([str(embedded), *explicit]) == [str(embedded), *explicit]
    other = str(tmp_path / "user-model")
    assert cli._embedded_model_dtype_args([other]) == [other]
    cpu("AVX512", avx512_bf16=True)
    assert cli._embedded_model_dtype_args([str(embedded)]) == [str(embedded)]


def test_cpu_check_reports_what_decides_the_dtype(cpu):
    cpu("AVX2")
    report = model.cpu_check(size=16, repeats=1)
    assert report["cpu_capability"] == "AVX2" and report["bf16_native"] is False
    assert report["engine_dtype"] == "float32"
    assert set(report["matmul_gflops_1_thread"]) == {"float32", "bfloat16"}
    assert all(v > 0 for v in report["matmul_gflops_1_thread"].values())
