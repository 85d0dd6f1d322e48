#!/usr/bin/env python3
"""Check 0: does the carried vLLM import over the GPU machine's torch, and is every module its offline path needs
there? Writes ``env.json``: versions, the CUDA device, vLLM's compiled extensions (``_C``, FA3) and platform, the
plugin's entry point, each of vLLM's requirements against what is installed, and ``missing_modules``: every module
that failed to import, by name, so the next carry can add it (tools/gpu/build_carry.py CORE_SEEDS).

No engine is started: this takes seconds.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import json
import os
import time
from pathlib import Path

import gpu_common

#: Imported one by one; a failure is recorded and the next one is tried.
MODULES = (
    "torch",
    "triton",
    "transformers",
    "vllm",
    "vllm._C_stable_libtorch",
    "vllm.vllm_flash_attn.flash_attn_interface",
    "vllm.platforms",
    "vllm.entrypoints.llm",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.attention.backends.fa_utils",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.model_loader.dummy_loader",
    "vllm.compilation.backends",
    "vllm.v1.core.sched.scheduler",
    "rcstat_vllm",
    "rcstat_vllm.plugin",
    "rcstat_vllm.attention.cuda_backend",
    "rcstat_vllm.kernels.rc_scoring",
    "rcstat_vllm.kernels.snapkv_scoring",
    "rcstat_vllm.api",
)


def requirement_report() -> dict:
    """vLLM's Requires-Dist (no extras) against the installed distributions."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return {"error": "packaging not importable"}
    env = {"extra": ""}
    rows, unmet = [], []
    for line in metadata.requires("vllm") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            have = None
        ok = have is not None and (not req.specifier or req.specifier.contains(have, prereleases=True))
        rows.append({"requirement": str(req), "installed": have, "ok": ok})
        if not ok:
            unmet.append(f"{req} (installed: {have})")
    return {"unmet": unmet, "all": rows}


def carried_requirements() -> list[str]:
    """Requirements of the carried wheels on packages assumed to be on the GPU machine, where unmet there."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return []
    site = Path(os.environ.get("RCSTAT_SITE", "/tmp/rcstat-vllm-site"))
    unmet = []
    for info in sorted(site.glob("*.dist-info")):
        try:
            dist = metadata.Distribution.at(info)
            if (dist.metadata["Name"] or "").lower() == "vllm":
                continue  # reported by requirement_report
            for line in dist.requires or []:
                req = Requirement(line)
                if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                    continue
                try:
                    have = metadata.version(req.name)
                except metadata.PackageNotFoundError:
                    have = None
                if have is None or (req.specifier and not req.specifier.contains(have, prereleases=True)):
                    unmet.append(f"{dist.metadata['Name']} needs {req} (installed: {have})")
        except Exception as exc:  # noqa: BLE001
            unmet.append(f"{info.name}: {exc!r}")
    return unmet


def main() -> int:
    t0 = time.perf_counter()
    result: dict = {"check": "env", "environment": gpu_common.environment(), "imports": {}, "missing_modules": []}
    for name in MODULES:
        t = time.perf_counter()
        try:
            importlib.import_module(name)
            result["imports"][name] = {"ok": True, "s": round(time.perf_counter() - t, 2)}
        except BaseException as exc:  # noqa: BLE001 - SystemExit/ImportError/OSError alike
            info = gpu_common.failure(exc)
            info.pop("traceback_tail", None)
            result["imports"][name] = info
            missing = info.get("missing_module")
            if missing and missing not in result["missing_modules"]:
                result["missing_modules"].append(missing)
    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fa

        result["flash_attn"] = {
            "FA2_AVAILABLE": fa.FA2_AVAILABLE,
            "FA3_AVAILABLE": fa.FA3_AVAILABLE,
            "FA3_UNAVAILABLE_REASON": fa.FA3_UNAVAILABLE_REASON,
            "FA2_UNAVAILABLE_REASON": fa.FA2_UNAVAILABLE_REASON,
        }
        result["flash_attn"]["fa3_supported"] = fa.is_fa_version_supported(3)
        result["flash_attn"]["fa3_unsupported_reason"] = fa.fa_version_unsupported_reason(3)
    except BaseException as exc:  # noqa: BLE001
        result["flash_attn"] = gpu_common.failure(exc)
    try:
        from vllm.platforms import current_platform

        result["platform"] = f"{type(current_platform).__module__}.{type(current_platform).__qualname__}"
        result["platform_device"] = current_platform.get_device_name()
    except BaseException as exc:  # noqa: BLE001
        result["platform"] = gpu_common.failure(exc)
    try:
        eps = metadata.entry_points(group="vllm.general_plugins")
        result["general_plugins"] = {ep.name: ep.value for ep in eps}
    except Exception as exc:  # noqa: BLE001
        result["general_plugins"] = repr(exc)
    try:
        result["vllm_requirements"] = requirement_report()
    except Exception as exc:  # noqa: BLE001
        result["vllm_requirements"] = repr(exc)
    result["carried_wheels_unmet"] = carried_requirements()
    try:  # vLLM checks the patched contracts when it loads the plugin; loading it here shows a mismatch early
        from rcstat_vllm.plugin import register

        register()
        result["plugin_register"] = {"ok": True}
    except BaseException as exc:  # noqa: BLE001
        result["plugin_register"] = gpu_common.failure(exc)
    needed = (
        "vllm",
        "vllm._C_stable_libtorch",
        "vllm.entrypoints.llm",
        "vllm.v1.worker.gpu_model_runner",
        "vllm.v1.attention.backends.flash_attn",
        "rcstat_vllm.plugin",
        "rcstat_vllm.attention.cuda_backend",
    )
    bad = [n for n in needed if not result["imports"].get(n, {}).get("ok")]
    fa3 = isinstance(result.get("flash_attn"), dict) and result["flash_attn"].get("FA3_AVAILABLE")
    result["ok"] = not bad and bool(fa3) and result["plugin_register"].get("ok", False)
    result["headline"] = (
        f"vllm {result['environment'].get('vllm')} on {result['environment'].get('device')}, "
        f"torch {result['environment'].get('torch')}; FA3 {'yes' if fa3 else 'NO'}; "
        f"failed imports: {bad or 'none'}; missing modules: {result['missing_modules'] or 'none'}"
    )
    result["seconds"] = round(time.perf_counter() - t0, 1)
    gpu_common.write_result("env", result)
    print(result["headline"])
    print(
        json.dumps(
            {
                "missing_modules": result["missing_modules"],
                "unmet": (result["vllm_requirements"] or {}).get("unmet")
                if isinstance(result["vllm_requirements"], dict)
                else None,
            }
        )
    )
    return 0


if __name__ == "__main__":
    gpu_common.run_main(main, "env", worker=False)
