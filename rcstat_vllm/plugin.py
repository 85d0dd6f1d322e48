"""vLLM general plugin entry point (``vllm.general_plugins``: ``rcstat = rcstat_vllm.plugin:register``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), sometimes more
than once. It installs the hooks in ``patches/``; each hook passes straight through unless the engine was
started with ``--additional-config '{"rcstat": {...}}'``, so without the flag vLLM behaves as if the plugin
were not installed.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from rcstat_vllm.patches import install_all

    install_all()
    _registered = True
