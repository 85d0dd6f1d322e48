"""One fake ``VllmConfig`` for the tests that build the plugin's worker state without an engine: only the fields the
plugin reads, with vLLM's meaning."""

from __future__ import annotations

from types import SimpleNamespace


def fake_vllm_config(
    rcstat: dict | None = None,
    block_size: int = 16,
    *,
    context: dict | None = None,
    offloading: float | None = None,
    kv_transfer: object = None,
    max_num_seqs: int = 256,
    max_model_len: int = 4096,
    **fields,
) -> SimpleNamespace:
    """``rcstat``: the plugin's settings (None: the flag is off); ``fields`` replace whole sub-configs
    (e.g. ``parallel_config``, ``speculative_config``); a ``model_config`` given there gains ``max_model_len``."""
    config = SimpleNamespace(
        additional_config={} if rcstat is None else {"rcstat": rcstat},
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        compilation_config=SimpleNamespace(static_forward_context=context or {}),
        cache_config=SimpleNamespace(block_size=block_size, kv_offloading_size=offloading),
        kv_transfer_config=kv_transfer,
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        model_config=SimpleNamespace(max_model_len=max_model_len),
    )
    for name, value in fields.items():
        setattr(config, name, value)
    if not hasattr(config.model_config, "max_model_len"):
        config.model_config.max_model_len = max_model_len
    return config
