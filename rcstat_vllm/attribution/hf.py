"""The transformers path: post-RoPE q/k of a Hugging Face Llama, captured with forward hooks, and attribution
of a prompt + generation from them. The reference for the vLLM path and the evaluation path of benchmarks.

Capture: forward hooks on every layer's ``self_attn.q_proj`` and ``self_attn.k_proj`` keep their outputs
(pre-RoPE); RoPE is then applied exactly as the model does (``model.model.rotary_emb`` for the positions and
the modeling module's ``apply_rotary_pos_emb``), giving the q/k the attention kernel multiplies. One forward
over prompt + generation (no KV cache) gives every token's q/k, so the generation's last token has its q/k
too (vLLM never computes them: its trace lacks that one token).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rcstat_vllm.attribution.head_weights import HeadWeights, load_head_weights
from rcstat_vllm.attribution.options import AttributionOptions
from rcstat_vllm.attribution.report import AttributionResult, build_result
from rcstat_vllm.attribution.trace import AttributionTrace

__all__ = ["attribute", "capture_qk", "chat_prompt", "generate", "load_model", "trace_sequence"]


def load_model(model_dir: str | Path | None = None, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of a causal LM folder (default: the embedded SmolLM2), eager attention, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_dir is None:
        from rcstat_vllm.model import default_model_dir

        model_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    model.eval()
    return model, tokenizer


def _decoder(model):
    inner = getattr(model, "model", model)
    if not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        raise TypeError(f"{type(model).__name__}: expected a Llama-style model with .model.layers and rotary_emb")
    return inner


def _apply_rope_fn(model):
    module = importlib.import_module(type(model).__module__)
    fn = getattr(module, "apply_rotary_pos_emb", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as fn
    return fn


@torch.no_grad()
def capture_qk(model, input_ids: Sequence[int] | torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Post-RoPE queries [T, Hq, D] and keys [T, Hkv, D] of every layer for one sequence.

    Returns:
        (queries, keys): one tensor per layer, in the model's dtype.
    """
    decoder = _decoder(model)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    raw_q: dict[int, torch.Tensor] = {}
    raw_k: dict[int, torch.Tensor] = {}
    handles = []
    for index, layer in enumerate(decoder.layers):
        attn = layer.self_attn
        handles.append(attn.q_proj.register_forward_hook(lambda _m, _i, out, i=index: raw_q.__setitem__(i, out)))
        handles.append(attn.k_proj.register_forward_hook(lambda _m, _i, out, i=index: raw_k.__setitem__(i, out)))
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    dummy = raw_q[0].new_zeros(1, ids.shape[1], head_dim)
    cos, sin = decoder.rotary_emb(dummy, positions)
    apply_rope = _apply_rope_fn(model)
    queries, keys = [], []
    for index in range(len(decoder.layers)):
        q = raw_q[index].view(1, ids.shape[1], -1, head_dim).transpose(1, 2)  # [1, Hq, T, D]
        k = raw_k[index].view(1, ids.shape[1], -1, head_dim).transpose(1, 2)
        q, k = apply_rope(q, k, cos, sin)
        queries.append(q[0].transpose(0, 1).contiguous())  # [T, Hq, D]
        keys.append(k[0].transpose(0, 1).contiguous())
    return queries, keys


@torch.no_grad()
def generate(model, tokenizer, prompt_ids: Sequence[int], max_new_tokens: int = 64) -> list[int]:
    """Greedy generation (ids of the new tokens, stopping at EOS, which is kept)."""
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long).reshape(1, -1)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    return out[0, ids.shape[1] :].tolist()


#: ``calibration`` default of :func:`trace_sequence`: the model's own file (looked up from its folder)
FROM_MODEL = "model"


def model_calibration(model) -> HeadWeights | None:
    """The calibration file of ``model``'s folder (``name_or_path``), as the vLLM path loads it; None if absent."""
    folder = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return load_head_weights(folder) if folder else None


def trace_sequence(
    model,
    prompt_ids: Sequence[int],
    generated_ids: Sequence[int],
    options: AttributionOptions | None = None,
    calibration: HeadWeights | str | None = FROM_MODEL,
) -> AttributionTrace:
    """The reference (every head kept) trace of prompt + generation; ``calibration``: the model's calibration
    file (default, as served), given weights, or None (the RC ranking)."""
    if calibration == FROM_MODEL:
        calibration = model_calibration(model)
    queries, keys = capture_qk(model, list(prompt_ids) + list(generated_ids))
    return AttributionTrace.from_sequence(
        queries,
        keys,
        len(prompt_ids),
        options,
        calibration=calibration if isinstance(calibration, HeadWeights) else None,
    )


def chat_prompt(tokenizer, user_message: str, system: str | None = None) -> str:
    """The rendered chat prompt (text) for one user message, ending with the assistant header."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_message}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def attribute(
    model,
    tokenizer,
    prompt: str,
    generated_ids: Sequence[int] | None = None,
    *,
    max_new_tokens: int = 64,
    options: AttributionOptions | dict[str, Any] | None = None,
    spans: str = "sentences",
    chunks: Sequence | None = None,
    generated_spans: str | Sequence[tuple[int, int]] = "sentences",
    top: int = 3,
) -> AttributionResult:
    """Attribute a generation to spans of ``prompt`` (the prompt text exactly as the model sees it, e.g. a
    rendered chat template). Generates greedily when ``generated_ids`` is None.

    Args:
        spans: prompt spans: ``sentences``, ``chunks`` (``chunks`` = strings found in the prompt or [start, end)
            character ranges) or ``tokens``.
        generated_spans: ``sentences`` (each generated sentence), ``all`` (the whole generation as one span),
            or character ranges of the generated text.
        top: how many best prompt spans to list per generated span.
    """
    if isinstance(options, dict) or options is None:
        options = AttributionOptions.from_dict(options)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if generated_ids is None:
        generated_ids = generate(model, tokenizer, prompt_ids, max_new_tokens)
    trace = trace_sequence(model, prompt_ids, generated_ids, options)
    return build_result(
        trace,
        tokenizer,
        prompt,
        prompt_ids,
        generated_ids,
        spans=spans,
        chunks=chunks,
        generated_spans=generated_spans,
        top=top,
    )
