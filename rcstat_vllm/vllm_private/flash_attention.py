"""vLLM's FlashAttention backend classes the plugin's CUDA backend extends (``rcstat_vllm/attention/cuda_backend.py``),
and the FlashAttention kernels it calls over head pages.

Imported from here only, so that every private vLLM name the package reads sits in this adapter package; the classes'
methods and the kernels' signatures are pinned by the contracts in :mod:`rcstat_vllm.vllm_private.attention_contracts`.
vLLM's CPU wheel imports the backend module but has no kernels: those are imported at first use (CUDA only)."""

from vllm.v1.attention.backend import AttentionCGSupport  # noqa: F401
from vllm.v1.attention.backends.flash_attn import (  # noqa: F401
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: F401


def get_flash_attn_version(**kwargs):
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version as version

    return version(**kwargs)


def reshape_and_cache_flash(*args):
    from vllm.v1.attention.backends.fa_utils import reshape_and_cache_flash as write

    return write(*args)


def flash_attn_varlen_func(**kwargs):
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func as attend

    return attend(**kwargs)
