"""Where the plugin keeps its files: converted models, attribution calibrations (``$RCSTAT_VLLM_CACHE``, else
``$XDG_CACHE_HOME/rcstat-vllm``)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """Where converted models live: ``$RCSTAT_VLLM_CACHE`` or ``$XDG_CACHE_HOME/rcstat-vllm``."""
    if os.environ.get("RCSTAT_VLLM_CACHE"):
        return Path(os.environ["RCSTAT_VLLM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rcstat-vllm"
