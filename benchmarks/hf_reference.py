"""A transformers reference of what the plugin does: full-attention prefill, then decode against a prompt KV
cache from which each (layer, KV head) has evicted its own tokens. Shared by quality.py (value error rate)
and accuracy.py (fidelity check against vLLM).

How it maps onto the plugin (rcstat_vllm/worker/prompt_compression.py):

* Prefill runs uncompressed (the plugin compresses after the last prefill chunk), so the prompt's hidden
  states, its KV and the first generated token are those of the full cache. It uses torch SDPA (causal),
  the same math as eager attention; it is identical for every method, so it is computed once per prompt.
* Scoring uses the same scorers and selection functions as the plugin, on the same inputs: per layer the
  last ``window_queries(config)`` prompt queries after RoPE ([Hq, w, d]) and the prompt keys after RoPE and
  values ([Hkv, n, d]), the layer's softmax scale, a fresh scorer per request (so ``random`` draws the same
  sequence), ``layer_budgets.keep_masks`` (threshold, per-layer or model-wide budget) as the plugin selects.
* Decode runs an explicit (eager) softmax attention per KV head in which query rows of generated tokens
  cannot see the evicted prompt keys of that (layer, KV head); generated tokens always see each other.
  The per-query-head attention output (softmax-weighted value sum, before o_proj) of every layer is
  returned for the value error rate.

Everything is batch size 1 and CPU-friendly; no KV cache object of transformers is used (the prompt's K/V
are kept here, per layer, and the model is called with explicit position ids and ``use_cache=False``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import layer_budgets  # (a sibling: benchmarks run with this folder on the path)
import torch
import torch.nn.functional as F
from torch import Tensor

from rcstat_vllm.config import RCStatConfig
from rcstat_vllm.scoring import get_scorer
from rcstat_vllm.settings import scorer_options, window_queries
from rcstat_vllm.worker.prompt_compression import page_aligned_masks

ATTN_NAME = "rcstat_bench_masked"
#: The widest window any scorer reads (SnapKV's 64); prefill keeps this many trailing queries per layer.
MAX_WINDOW = 64


@dataclass
class _State:
    mode: str = "off"  # "prefill" | "decode"
    keep_queries: int = MAX_WINDOW
    # prefill captures, per layer
    keys: dict = field(default_factory=dict)  # layer -> [Hkv, n, d]
    values: dict = field(default_factory=dict)
    queries: dict = field(default_factory=dict)  # layer -> [Hq, w, d]
    # decode inputs
    prompt_keys: dict | None = None
    prompt_values: dict | None = None
    masks: list | None = None  # per layer [Hkv, n] bool (True = keep) or None = keep all
    evicted: str | None = None  # one of EVICTED_SUMMARIES: an entry per head for its evicted entries (or none)
    extra_keys: dict = field(default_factory=dict)  # generated tokens so far (incremental greedy decode)
    extra_values: dict = field(default_factory=dict)
    append: bool = False
    # decode outputs, per layer [T, Hq, d]
    outputs: dict = field(default_factory=dict)


_STATE = _State()

#: What stands for a head's evicted prompt entries in the reference's decode (``greedy``/``decode``'s ``evicted``):
#: ``mass_mean``: one entry with their exact share of each query's softmax and the plain mean of their values
#: (an oracle: it reads every evicted key); ``merged``: one entry with their keys' mean, its logit raised by the
#: log of their count, and their values' mean (what a kernel with a per-entry logit bias could serve). Renormalising
#: over the kept entries alone (none) is what the plugin does.
EVICTED_SUMMARIES = ("mass_mean", "merged")


def evicted_summary(how: str, q: Tensor, logits: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scaling: float):
    """One entry per KV head standing for its evicted prompt entries (``mask`` [Hkv, n], True = kept), as
    :data:`EVICTED_SUMMARIES` says: its logit for each query [Hkv, G, T, 1] and its value [Hkv, d] (q [Hkv, G, T, d],
    ``logits`` [Hkv, G, T, S] before masking, ``keys``/``values`` [Hkv, S, d]). A head that evicted nothing gets a
    logit of -inf."""
    if how not in EVICTED_SUMMARIES:
        raise ValueError(f"evicted summary {how!r}: one of {EVICTED_SUMMARIES}")
    n = mask.shape[1]
    evicted = ~mask
    count = evicted.sum(dim=1)  # [Hkv]
    weights = evicted.float() / count.clamp_min(1).unsqueeze(1)
    mean_value = torch.einsum("hn,hnd->hd", weights, values[:, :n].float())
    if how == "mass_mean":
        logit = logits[..., :n].masked_fill(mask[:, None, None, :], float("-inf")).logsumexp(dim=-1, keepdim=True)
    else:
        mean_key = torch.einsum("hn,hnd->hd", weights, keys[:, :n].float())
        logit = torch.einsum("hgtd,hd->hgt", q.float(), mean_key).unsqueeze(-1) * scaling
        logit = logit + count.clamp_min(1).float().log()[:, None, None, None]
    return logit.masked_fill((count == 0)[:, None, None, None], float("-inf")), mean_value


def _masked_attention(
    module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling: float, dropout: float = 0.0, **kwargs
):
    """transformers attention interface: query [1, Hq, T, d], key/value [1, Hkv, T, d] (RoPE applied)."""
    st = _STATE
    layer = module.layer_idx
    if query.shape[0] != 1:
        raise ValueError("the reference runs batch size 1")
    num_q, num_kv = query.shape[1], key.shape[1]
    group = num_q // num_kv
    if st.mode == "prefill":
        st.keys[layer] = key[0]
        st.values[layer] = value[0]
        st.queries[layer] = query[0, :, -st.keep_queries :]
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    if st.mode != "decode":
        raise RuntimeError("reference model called outside prefill()/decode()")
    t = query.shape[2]
    pk, pv = st.prompt_keys[layer], st.prompt_values[layer]
    n = pk.shape[1]
    parts_k, parts_v = [pk], [pv]
    if layer in st.extra_keys:
        parts_k.append(st.extra_keys[layer])
        parts_v.append(st.extra_values[layer])
    parts_k.append(key[0])
    parts_v.append(value[0])
    keys = torch.cat(parts_k, dim=1)  # [Hkv, S, d]
    values = torch.cat(parts_v, dim=1)
    s = keys.shape[1]
    extra = s - n - t
    if st.append:
        st.extra_keys[layer] = keys[:, n:]
        st.extra_values[layer] = values[:, n:]
    q = query[0].reshape(num_kv, group, t, -1)  # query head h reads KV head h // group
    logits = torch.einsum("hgtd,hsd->hgts", q.float(), keys.float()) * scaling
    # Visibility [Hkv, 1, T, S]: prompt part per head from its keep mask, generated part causal.
    visible = torch.ones(num_kv, 1, t, s, dtype=torch.bool)
    mask = st.masks[layer] if st.masks is not None else None
    if mask is not None:
        visible[:, :, :, :n] = mask[:, None, None, :]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    visible[:, :, :, n + extra :] = causal
    summary = None
    if mask is not None and st.evicted is not None:
        summary = evicted_summary(st.evicted, q, logits, keys, values, mask, scaling)
    logits = logits.masked_fill(~visible, float("-inf"))
    values = values.float()
    if summary is not None:  # one more entry per head, after the others
        logits = torch.cat([logits, summary[0]], dim=-1)
        values = torch.cat([values, summary[1].unsqueeze(1)], dim=1)
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("hgts,hsd->hgtd", probs, values)  # [Hkv, G, T, d]
    out = out.reshape(num_q, t, -1).transpose(0, 1)  # [T, Hq, d]
    st.outputs[layer] = out
    return out.unsqueeze(0).to(query.dtype), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _masked_attention)


@dataclass
class Prefill:
    """One prompt's uncompressed prefill: per-layer K/V and trailing queries, and the first greedy token."""

    ids: list[int]
    keys: dict
    values: dict
    queries: dict
    first_token: int
    scale: float
    num_layers: int

    @property
    def n(self) -> int:
        return len(self.ids)


class ReferenceModel:
    """A Llama causal LM from transformers with the masked-decode attention above."""

    def __init__(self, model_dir: str | Path | None = None, dtype: torch.dtype = torch.float32, model=None):
        from transformers import AutoModelForCausalLM

        _register()
        if model is None:
            if model_dir is None:
                from rcstat_vllm.model import default_model_dir

                model_dir = default_model_dir()
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="eager")
        model.eval()
        model.config._attn_implementation = ATTN_NAME
        for module in model.modules():
            if hasattr(module, "config") and hasattr(module.config, "_attn_implementation"):
                module.config._attn_implementation = ATTN_NAME
        self.model = model
        cfg = model.config
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = cfg.num_key_value_heads
        self.num_q_heads = cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim**-0.5
        eos = getattr(model.generation_config, "eos_token_id", None) or cfg.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()

    @torch.no_grad()
    def prefill(self, ids: list[int]) -> Prefill:
        st = _STATE
        st.__init__()
        st.mode = "prefill"
        try:
            out = self.model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)
        finally:
            st.mode = "off"
        result = Prefill(
            ids=list(ids),
            keys=dict(st.keys),
            values=dict(st.values),
            queries=dict(st.queries),
            first_token=int(out.logits[0, -1].argmax()),
            scale=self.scale,
            num_layers=self.num_layers,
        )
        st.__init__()
        return result

    @torch.no_grad()
    def decode(
        self,
        prefill: Prefill,
        tokens: list[int],
        masks: list[Tensor] | None = None,
        all_layers: bool = False,
        evicted: str | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Teacher-force ``tokens`` at positions n.. over the (masked) prompt KV (``evicted``: what stands for each
        head's evicted entries, :data:`EVICTED_SUMMARIES`; None: nothing, the plugin's attention).

        Returns (logits [T, V], attention outputs [T, Hq, d] of the last layer, or [L, T, Hq, d] with
        ``all_layers``), float32.
        """
        st = _STATE
        st.__init__()
        st.mode, st.prompt_keys, st.prompt_values, st.masks = "decode", prefill.keys, prefill.values, masks
        st.evicted = evicted
        n = prefill.n
        try:
            out = self.model(
                input_ids=torch.tensor([tokens]), position_ids=torch.arange(n, n + len(tokens))[None], use_cache=False
            )
        finally:
            st.mode = "off"
        if all_layers:
            attn = torch.stack([st.outputs[i] for i in range(self.num_layers)])
        else:
            attn = st.outputs[self.num_layers - 1]
        st.__init__()
        return out.logits[0].float(), attn.float()

    @torch.no_grad()
    def greedy(
        self,
        prefill: Prefill,
        max_new_tokens: int,
        masks: list[Tensor] | None = None,
        stop_at_eos: bool = True,
        stop: Callable[[list[int]], bool] | None = None,
        evicted: str | None = None,
    ) -> list[int]:
        """Greedy decode under the masks: the first token comes from the (uncompressed) prefill; ``stop(tokens)``
        true ends it early (after any token); ``evicted`` as in :meth:`decode`."""
        st = _STATE
        st.__init__()
        st.prompt_keys, st.prompt_values, st.masks, st.append = prefill.keys, prefill.values, masks, True
        st.evicted = evicted
        tokens = [prefill.first_token]
        n = prefill.n
        try:
            while len(tokens) < max_new_tokens and not (stop_at_eos and tokens[-1] in self.eos_ids):
                if stop is not None and stop(tokens):
                    break
                st.mode = "decode"
                pos = n + len(tokens) - 1
                out = self.model(
                    input_ids=torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[pos]]), use_cache=False
                )
                tokens.append(int(out.logits[0, -1].argmax()))
        finally:
            st.__init__()
        return tokens


# ----------------------------------------------------------------------------------------------- keep sets


@dataclass
class KeepMasks:
    """Per layer [Hkv, n] keep masks of one (prompt, method) and the achieved compression ratio."""

    masks: list[Tensor]
    kept: list[list[int]]  # [layer][kv head]
    ratio: float  # evicted / total prompt entries over all layers and heads (the plugin's definition)


def score_layers(prefill: Prefill, config: RCStatConfig) -> list[Tensor]:
    """Per layer [Hkv, n] scores exactly as the plugin computes them (a fresh scorer per request)."""
    scorer = get_scorer(config.method, **scorer_options(config))
    width = min(window_queries(config), prefill.n)
    scores = []
    for layer in range(prefill.num_layers):
        q_window = prefill.queries[layer][:, -width:].float()
        keys, values = prefill.keys[layer].float(), prefill.values[layer].float()
        scores.append(scorer.score(q_window, keys, values, prefill.scale))
    return scores


def select_layers(
    scores: list[Tensor],
    config: RCStatConfig,
    comparable: str | None = None,
    page_size: int | None = None,
    pooled: bool = True,
) -> KeepMasks:
    """The plugin's own selection (``select_keep_masks``) on the reference model's scores; with ``page_size``, each
    head's count then moved to a page boundary as the plugin's engine moves it (``page_aligned_masks``: over all
    layers' heads when ``pooled``, else each layer's), so that the keep sets are the engine's. Without it (the
    research benchmarks: routes, route_probes, quality) the selection rule alone: each head within a page of it."""
    masks = layer_budgets.keep_masks(scores, config, comparable)
    n = scores[0].shape[1]
    if page_size:
        pools = [list(range(len(masks)))] if pooled else [[layer] for layer in range(len(masks))]
        masks = page_aligned_masks(masks, scores, config, n, page_size, pools)
    kept = [mask.sum(dim=1).tolist() for mask in masks]
    total = sum(len(row) for row in kept) * n
    ratio = 1.0 - sum(map(sum, kept)) / total
    return KeepMasks(masks=masks, kept=kept, ratio=ratio)


def keep_masks(prefill: Prefill, config: RCStatConfig, page_size: int | None = None, pooled: bool = True) -> KeepMasks:
    return select_layers(score_layers(prefill, config), config, page_size=page_size, pooled=pooled)


def value_error(reference: Tensor, compressed: Tensor, eps: float = 1e-12) -> Tensor:
    """||v* - v^|| / ||v*|| per (token, head) over the last dim: [..., d] -> [...]."""
    return torch.linalg.vector_norm(reference - compressed, dim=-1) / torch.linalg.vector_norm(
        reference, dim=-1
    ).clamp_min(eps)
