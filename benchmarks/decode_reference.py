"""A transformers reference of decode-time eviction (issue 26): what RC and the baselines would keep of the
*generated* KV if the plugin compressed it every ``interval`` generated tokens, measured before any engine work.

Why a reference: the question is whether RC beats the simple baselines on generated KV at all, and at which
interval and budget. That is a property of the method and the model, not of vLLM, so it is measured here on
the embedded SmolLM2-135M (batch 1, CPU, float32), teacher-forced, where nothing else can differ.

How it runs (one ``replay`` of prompt P and a "generated" span G):

* The model is transformers' own, loaded by :class:`hf_reference.ReferenceModel`; the attention is swapped for
  :func:`_decode_attention` through transformers' ``AttentionInterface``. It keeps every layer's post-RoPE keys
  and values of all positions so far in a preallocated buffer, and a per-(layer, KV head) keep mask over them.
  Evicted entries stay in the buffer but are masked out (-inf logit), which is the same softmax as compacting.
* P runs in one call (causal, nothing evicted: the prompt's KV is never evicted here). G then runs in chunks of
  ``interval`` tokens; inside a chunk the queries see the kept keys plus the chunk causally, exactly what a
  step-by-step decode sees between two evictions.
* After each chunk, in every layer whose kept generated tokens exceed the budget, the kept generated keys are
  scored with the method (the plugin's scorers, ``rcstat_vllm.scoring``), with the queries of the last
  generated tokens as the observation window (the scorers read the trailing ``window_size`` of them), on each
  head's kept keys compacted (so smoothing and carry-forward see neighbours as a compacted cache would), and
  selected so that ``budget`` generated tokens per KV head stay on average. The last ``keep_window`` generated
  tokens (the plugin's ``window``, 32) are always kept, whatever the method; a method's own window (+inf
  scores: SnapKV's 64) too. Because the newest tokens are always kept, the observation window's positions are
  always the last kept keys of every head, which is what the scorers assume of their inputs.

Selections (``DecodeMethod.selection``):

* ``layer``: the layer's top ``Hkv * budget`` entries over all its heads, raw scores (the plugin's
  ``select_budget``), so heads keep different numbers; used for RC, SnapKV and K-norm.
* ``head``: every head keeps its own top ``budget`` (TOVA: its scores are the same for all heads, so all heads
  keep one set, as in the TOVA paper).
* ``head_mean``: as ``layer`` on each head's scores divided by its own mean (finite scores): RC's threshold rule
  (Eq. 9) with the one c per layer that meets the budget, so heads on a larger logit scale do not crowd out others.
* ``threshold``: RC's Eq. 9 per head (evict score <= c * the head's mean) whenever the layer is over budget; the
  kept number is an outcome.
* method ``recent``: every head keeps its last ``budget`` generated tokens (StreamingLLM with the prompt as sinks).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hf_reference as ref_lib

from rcstat_vllm.config import RCStatConfig
from rcstat_vllm.scoring import get_scorer, relative_to_head_mean, select_threshold
from rcstat_vllm.settings import scorer_options

ATTN_NAME = "rcstat_bench_decode"
#: Trailing generated queries kept per layer: the widest window any scorer reads (SnapKV's 64).
MAX_WINDOW = ref_lib.MAX_WINDOW
#: The newest generated tokens every method keeps: the plugin's ``window`` (all methods keep it on prompts too).
KEEP_WINDOW = RCStatConfig().window


@dataclass
class DecodeMethod:
    """One decode-time eviction setting. ``method``: ``none`` (full cache), ``recent`` or a scorer name;
    ``budget``: generated tokens kept per KV head (a layer mean for ``layer`` selection); ``interval``: generated
    tokens between two evictions (and the replay's chunk size); ``options``: scorer options (None: the plugin's
    defaults, :func:`default_options`)."""

    label: str
    method: str
    budget: int = 0
    interval: int = 128
    selection: str = "layer"
    c: float = 1.0
    options: dict | None = None
    keep_window: int = KEEP_WINDOW

    def scorer(self):
        if self.method in ("none", "recent"):
            return None
        return get_scorer(self.method, **(default_options(self.method) if self.options is None else self.options))

    def to_dict(self) -> dict:
        return {
            "label": self.label,
            "method": self.method,
            "budget": self.budget,
            "interval": self.interval,
            "selection": self.selection,
            "c": self.c if self.selection == "threshold" else None,
            "options": default_options(self.method) if self.options is None else self.options,
        }


def default_options(method: str) -> dict:
    """The scorer options the plugin would use for ``method`` (RC: ``RCStatConfig()``'s window 32, smoothing 3,
    carry_forward 8; the baselines their published defaults)."""
    if method in ("none", "recent"):
        return {}
    return scorer_options(RCStatConfig(method=method))


# ----------------------------------------------------------------------------------------------- the cache


@dataclass
class _Cache:
    """Per layer: K/V of every position so far ([Hkv, capacity, d], post-RoPE), the keep mask ([Hkv, capacity]),
    how many positions are filled, and the last ``MAX_WINDOW`` queries of generated tokens ([Hq, <=64, d])."""

    capacity: int
    prompt_len: int = 0
    keys: dict = field(default_factory=dict)
    values: dict = field(default_factory=dict)
    keep: dict = field(default_factory=dict)
    length: dict = field(default_factory=dict)
    queries: dict = field(default_factory=dict)
    record_queries: bool = False  # False while the prompt runs: the window is made of generated queries
    outputs: dict = field(default_factory=dict)  # layer -> [T, Hq, d] of the current call


_ACTIVE: list[_Cache] = []  # the cache the current forward reads (a list: set/cleared around each call)


def _decode_attention(
    module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling: float, dropout: float = 0.0, **kwargs
):
    """transformers attention interface: query [1, Hq, T, d], key/value [1, Hkv, T, d] of the T new positions
    (RoPE applied). Appends them to the cache and attends over the kept old positions plus the new ones causally."""
    cache = _ACTIVE[-1]
    layer = module.layer_idx
    q, k, v = query[0].float(), key[0].float(), value[0].float()
    num_q, t, _ = q.shape
    num_kv = k.shape[0]
    if layer not in cache.keys:
        cache.keys[layer] = k.new_zeros(num_kv, cache.capacity, k.shape[-1])
        cache.values[layer] = v.new_zeros(num_kv, cache.capacity, v.shape[-1])
        cache.keep[layer] = torch.zeros(num_kv, cache.capacity, dtype=torch.bool)
        cache.length[layer] = 0
    start = cache.length[layer]
    end = start + t
    cache.keys[layer][:, start:end] = k
    cache.values[layer][:, start:end] = v
    cache.keep[layer][:, start:end] = True
    cache.length[layer] = end
    if cache.record_queries:
        old = cache.queries.get(layer)
        cache.queries[layer] = (q if old is None else torch.cat([old, q], dim=1))[:, -MAX_WINDOW:]
    keys, values = cache.keys[layer][:, :end], cache.values[layer][:, :end]
    qg = q.reshape(num_kv, num_q // num_kv, t, -1)  # query head h reads KV head h // G
    logits = torch.einsum("hgtd,hsd->hgts", qg, keys) * scaling
    visible = torch.empty(num_kv, 1, t, end, dtype=torch.bool)
    visible[..., :start] = cache.keep[layer][:, None, None, :start]
    visible[..., start:] = torch.ones(t, t, dtype=torch.bool).tril()
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    out = torch.einsum("hgts,hsd->hgtd", probs, values).reshape(num_q, t, -1).transpose(0, 1)  # [T, Hq, d]
    cache.outputs[layer] = out
    return out.unsqueeze(0).to(query.dtype), None


# ----------------------------------------------------------------------------------------------- eviction


def _top(priority: Tensor, count: int) -> Tensor:
    """Bool mask of the ``count`` highest entries of a 1-D priority (stable: ties go to the lower index)."""
    order = torch.sort(priority.to(torch.float64), descending=True, stable=True).indices
    mask = torch.zeros_like(priority, dtype=torch.bool)
    mask[order[:count]] = True
    return mask


def evict_layer(
    keep: Tensor, keys: Tensor, values: Tensor, queries: Tensor | None, method: DecodeMethod, scorer, scale: float
) -> Tensor | None:
    """New keep mask [Hkv, g] of one layer's generated region, or None when the layer is within budget.

    ``keep``: [Hkv, g] current keep mask of the g generated positions; ``keys``/``values``: [Hkv, g, d] their
    K/V; ``queries``: [Hq, w, d] the last generated positions' queries (the observation window).
    """
    num_kv, _g = keep.shape
    counts = keep.sum(dim=1)
    over = (
        int(counts.sum()) > num_kv * method.budget
        if method.selection in ("layer", "head_mean", "threshold")
        else int(counts.max()) > method.budget
    )
    if not over:
        return None
    if method.method == "recent":
        from_end = keep.flip(1).cumsum(1).flip(1)  # kept tokens at or after each position
        return keep & (from_end <= max(method.budget, method.keep_window))
    idx = [torch.nonzero(row).squeeze(1) for row in keep]
    if all(torch.equal(idx[0], i) for i in idx[1:]):  # one kept set: score the layer at once (TOVA needs it)
        rows = list(scorer.score(queries, keys[:, idx[0]], values[:, idx[0]], scale).unbind(0))
    else:  # compacted per head: head h with its G query heads
        group = queries.shape[0] // num_kv
        rows = [
            scorer.score(
                queries[h * group : (h + 1) * group], keys[h : h + 1, idx[h]], values[h : h + 1, idx[h]], scale
            )[0]
            for h in range(num_kv)
        ]
    rows = [r.clone() for r in rows]
    for r in rows:
        r[-method.keep_window :] = float("inf")  # the newest tokens stay, whatever the method
    if method.selection == "threshold":
        chosen = [select_threshold(r[None], 0, method.c).mask[0] for r in rows]
    elif method.selection == "head":
        chosen = [_top(r, max(method.budget, int(torch.isinf(r).sum()))) for r in rows]
    elif method.selection in ("layer", "head_mean"):
        if method.selection == "head_mean":  # each head's scores / its mean: Eq. 9's yardstick, one c per layer
            # the plugin's own (rcstat_vllm.scoring): the newest tokens are +inf here, so no window to leave out
            rows = [relative_to_head_mean(r[None], 0)[0] for r in rows]
        flat = torch.cat(rows)
        flat_mask = _top(flat, max(num_kv * method.budget, int(torch.isinf(flat).sum())))
        chosen = list(flat_mask.split([len(r) for r in rows]))
    else:
        raise ValueError(f"unknown selection {method.selection!r}")
    new = torch.zeros_like(keep)
    for h in range(num_kv):
        new[h, idx[h][chosen[h]]] = True
    return new


# ----------------------------------------------------------------------------------------------- the model


@dataclass
class Replay:
    """One teacher-forced replay of G after P. Position i (0-based in G) is G[i]'s forward pass: its prediction
    is of the token after G[i].

    Attributes:
        argmax:  [T] next-token argmax per position.
        target_logprob: [T] log-probability of G[i + 1] at position i (NaN at the last position).
        logits:  [T, V] (only with ``return_logits``; 2048 x 49152 float32 is 400 MB).
        attn:    [T, Hq, d] last layer's attention outputs (before o_proj), or [L, T, Hq, d] with ``all_layers``.
        first_eviction: index in G of the first position computed after an eviction (None: none happened).
        evictions: per eviction, (G index after which it ran, [L, Hkv] kept generated tokens after it).
        peak_kept: the most generated tokens any (layer, head) held at once.
        mean_visible: generated tokens a query sees, mean over G's positions and all (layer, KV head): what the
            cache holds on average (budget + about interval / 2 once evicting), to compare intervals fairly.
    """

    argmax: Tensor
    target_logprob: Tensor
    logits: Tensor | None
    attn: Tensor
    first_eviction: int | None
    evictions: list = field(default_factory=list)
    peak_kept: int = 0
    mean_visible: float = 0.0

    def kept_after_evictions(self) -> float | None:
        """Mean kept generated tokens per (layer, KV head) right after an eviction (over all evictions)."""
        if not self.evictions:
            return None
        return float(torch.stack([k.float() for _, k in self.evictions]).mean())


class DecodeReference:
    """The reference model with :func:`_decode_attention` (see the module docstring)."""

    def __init__(self, model_dir: str | Path | None = None, model=None):
        from transformers import AttentionInterface

        base = ref_lib.ReferenceModel(model_dir, dtype=torch.float32, model=model)  # loads, sets eval()
        AttentionInterface.register(ATTN_NAME, _decode_attention)
        self.model = base.model
        self._set_attention(ATTN_NAME)
        self.num_layers, self.num_kv_heads, self.num_q_heads = base.num_layers, base.num_kv_heads, base.num_q_heads
        self.scale, self.eos_ids = base.scale, base.eos_ids

    def _set_attention(self, name: str) -> None:
        self.model.config._attn_implementation = name
        for module in self.model.modules():
            if hasattr(module, "config") and hasattr(module.config, "_attn_implementation"):
                module.config._attn_implementation = name

    def _forward(self, cache: _Cache, ids: list[int], start: int, last_only: bool = False) -> Tensor:
        _ACTIVE.append(cache)
        try:
            out = self.model(
                input_ids=torch.tensor([ids]),
                position_ids=torch.arange(start, start + len(ids))[None],
                use_cache=False,
                logits_to_keep=1 if last_only else 0,
            )
        finally:
            _ACTIVE.pop()
        return out.logits[0].float()

    def _evict(self, cache: _Cache, method: DecodeMethod, scorer) -> Tensor | None:
        """Evict in every layer over budget; [L, Hkv] kept generated counts if any layer evicted, else None."""
        p, evicted = cache.prompt_len, False
        for layer in range(self.num_layers):
            end = cache.length[layer]
            keep = cache.keep[layer][:, p:end]
            new = evict_layer(
                keep,
                cache.keys[layer][:, p:end],
                cache.values[layer][:, p:end],
                cache.queries.get(layer),
                method,
                scorer,
                self.scale,
            )
            if new is not None:
                if bool((new & ~keep).any()):
                    raise AssertionError("an eviction re-admitted an evicted token")
                cache.keep[layer][:, p:end] = new
                evicted = True
        return self.kept_generated(cache) if evicted else None

    def kept_generated(self, cache: _Cache) -> Tensor:
        """[L, Hkv] kept generated tokens per (layer, KV head)."""
        p = cache.prompt_len
        return torch.stack([cache.keep[layer][:, p : cache.length[layer]].sum(1) for layer in range(self.num_layers)])

    def _prefill(self, prompt_ids: list[int], capacity: int) -> tuple[_Cache, Tensor]:
        cache = _Cache(capacity=capacity, prompt_len=len(prompt_ids))
        last = self._forward(cache, prompt_ids, 0, last_only=True)[-1]
        cache.record_queries = True
        return cache, last

    @torch.no_grad()
    def replay(
        self,
        prompt_ids: list[int],
        tokens: list[int],
        method: DecodeMethod,
        all_layers: bool = False,
        return_logits: bool = False,
        on_chunk=None,
    ) -> Replay:
        """Teacher-force ``tokens`` after ``prompt_ids`` with eviction every ``method.interval`` tokens."""
        scorer = method.scorer()
        cache, _ = self._prefill(prompt_ids, len(prompt_ids) + len(tokens))
        p, n = len(prompt_ids), len(tokens)
        argmax, logprob, logits_all, attn = [], [], [], []
        evictions, first_eviction, peak, visible = [], None, 0, 0.0
        for s in range(0, n, method.interval):
            chunk = tokens[s : s + method.interval]
            before = float(self.kept_generated(cache).float().mean()) if s else 0.0
            visible += len(chunk) * before + len(chunk) * (len(chunk) + 1) / 2  # query j sees before + j + 1
            logits = self._forward(cache, chunk, p + s)
            argmax.append(logits.argmax(-1))
            nxt = tokens[s + 1 : s + 1 + len(chunk)]  # one short at the end of the span
            lp = torch.log_softmax(logits, -1)[: len(nxt)].gather(1, torch.tensor(nxt)[:, None])[:, 0]
            logprob.append(torch.cat([lp, torch.full((len(chunk) - len(nxt),), float("nan"))]))
            if return_logits:
                logits_all.append(logits)
            outs = cache.outputs
            attn.append(
                torch.stack([outs[i] for i in range(self.num_layers)]) if all_layers else outs[self.num_layers - 1]
            )
            cache.outputs = {}
            peak = max(peak, int(self.kept_generated(cache).max()))
            if scorer is not None or method.method == "recent":
                kept = self._evict(cache, method, scorer)
                if kept is not None:
                    evictions.append((s + len(chunk), kept))
                    if first_eviction is None:
                        first_eviction = s + len(chunk)
            if on_chunk is not None:
                on_chunk(len(chunk))
        return Replay(
            argmax=torch.cat(argmax),
            target_logprob=torch.cat(logprob),
            logits=torch.cat(logits_all) if return_logits else None,
            attn=torch.cat(attn, dim=1 if all_layers else 0),
            first_eviction=first_eviction,
            evictions=evictions,
            peak_kept=peak,
            mean_visible=visible / n,
        )

    @torch.no_grad()
    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, method: DecodeMethod, stop_at_eos: bool = False
    ) -> list[int]:
        """Greedy decode one token at a time, evicting after every ``method.interval`` generated tokens (the same
        schedule as :meth:`replay`: an eviction follows the forward pass of G[k * interval - 1])."""
        scorer = method.scorer()
        cache, last = self._prefill(prompt_ids, len(prompt_ids) + max_new_tokens)
        tokens = [int(last.argmax())]
        p = len(prompt_ids)
        while len(tokens) < max_new_tokens and not (stop_at_eos and tokens[-1] in self.eos_ids):
            i = len(tokens) - 1
            logits = self._forward(cache, [tokens[-1]], p + i, last_only=True)
            cache.outputs = {}
            if (scorer is not None or method.method == "recent") and (i + 1) % method.interval == 0:
                self._evict(cache, method, scorer)
            tokens.append(int(logits[-1].argmax()))
        return tokens

    @torch.no_grad()
    def plain_logits(self, ids: list[int]) -> Tensor:
        """One ordinary forward of ``ids`` with transformers' own SDPA attention: [T, V] (the exactness check)."""
        self._set_attention("sdpa")
        try:
            return self.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
        finally:
            self._set_attention(ATTN_NAME)


FULL = DecodeMethod("full", "none", interval=256)
