"""tools/gpu's scripts loaded as modules for the tests: they are not a package (on a lent GPU machine they run as
scripts from the carried tree), so each test file loads them by path, under one name per script."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPU = REPO / "tools" / "gpu"


def load(name: str):
    """``tools/gpu/<name>.py`` as a fresh module ``tools_gpu_<name>``."""
    spec = importlib.util.spec_from_file_location(f"tools_gpu_{name}", GPU / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
