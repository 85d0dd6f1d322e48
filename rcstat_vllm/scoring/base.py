"""The interface every scoring method implements (in the spirit of kvpress's ScorerPress), and what they share.

A scorer turns one layer's prompt (trailing queries, keys, values) into one importance score per
(KV head, prompt token); :mod:`rcstat_vllm.scoring.selection` then decides what to keep. Higher = more
important; tokens a method always keeps (its observation window, its sinks) score +inf. The methods themselves
live one per module in :mod:`rcstat_vllm.scoring.methods`, each a dataclass whose fields are its knobs.

GQA convention (vLLM / HF): Hq = G * Hkv query heads, query head h reads KV head h // G. Methods that score
with queries compute one score per query head and average the G heads of a group (what kvpress/SnapKV do, see
FasterDecoding/SnapKV#22).

Inside the engine the prompt lives in a paged KV cache: :meth:`Scorer.score_paged` scores it there
(:class:`PagedPrompt`), with a Triton kernel that reads the keys in place where one computes the method
(RC and SnapKV, :mod:`rcstat_vllm.kernels`), otherwise by gathering only the tensors the method reads
(:attr:`Scorer.needs_keys`, :attr:`Scorer.needs_values`, :attr:`Scorer.needs_value_norms`) and calling
:meth:`Scorer.score`.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from rcstat_vllm.kernels.paged import gather_paged_tokens, host_to_device, paged_block_size, paged_token_norms

from .registry import REGISTRY

__all__ = [
    "PAGED_KERNEL_DTYPES",
    "PagedPrompt",
    "Scorer",
    "carry_forward",
    "chunk_mean",
    "group_queries",
    "local_contrast",
    "mark_window_kept",
    "ragged_padding",
    "smooth_scores",
    "value_weighted",
]


def group_queries(q_window: Tensor, num_kv_heads: int) -> Tensor:
    """[Hq, w, d] -> [Hkv, G, w, d]: query head h goes to KV head h // G (a view, no copy)."""
    num_q_heads = q_window.shape[0]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{num_q_heads} query heads do not split into {num_kv_heads} KV-head groups")
    return q_window.reshape(num_kv_heads, num_q_heads // num_kv_heads, *q_window.shape[1:])


def mark_window_kept(non_window_scores: Tensor, window: int) -> Tensor:
    """[Hkv, n - window] -> float32 [Hkv, n] with the window tokens at +inf."""
    kept = torch.full(
        (non_window_scores.shape[0], window), float("inf"), dtype=torch.float32, device=non_window_scores.device
    )
    return torch.cat([non_window_scores.to(torch.float32), kept], dim=1)


def ragged_padding(lengths: list[int], n: int, device: torch.device) -> Tensor:
    """[Hkv, n] bool: the columns before each head's own entries when head ``h``'s are the last ``lengths[h]`` of
    ``n`` (right-aligned, as :meth:`Scorer.score_ragged` lays them out); built from host lengths, no device read."""
    first = torch.tensor([n - length for length in lengths]).unsqueeze(1)
    return host_to_device(torch.arange(n) < first, device)  # (pinned and asynchronous to a GPU: no stream sync)


def smooth_scores(scores: Tensor, kernel_size: int) -> Tensor:
    """SnapKV's same-length average pooling along the last dim: [..., n] -> [..., n]."""
    if scores.shape[-1] == 0 or kernel_size == 1:
        return scores
    flat = scores.reshape(-1, 1, scores.shape[-1])
    pooled = F.avg_pool1d(flat, kernel_size=kernel_size, stride=1, padding=kernel_size // 2)
    return pooled.reshape(scores.shape)


def carry_forward(scores: Tensor, tokens: int) -> Tensor:
    """Each score raised to the highest of itself and the ``tokens`` scores before it: [..., n] -> [..., n].

    ``out[..., i] = max(scores[..., i - tokens : i + 1])``: a one-sided running max (a max-pool over the
    token and the ``tokens`` before it). Why RC wants it: the observation window's queries find *where* a fact
    is (the key a question names), but the tokens after it (the value, a name's continuation) are read only
    while the answer is generated, each by the query of the token generated before it, which the window has
    not got. Carrying a score forward keeps what follows a contextualized token with it.
    """
    if tokens == 0 or scores.shape[-1] == 0:
        return scores
    flat = scores.reshape(-1, 1, scores.shape[-1])
    padded = F.pad(flat, (tokens, 0), value=float("-inf"))
    return F.max_pool1d(padded, kernel_size=tokens + 1, stride=1).reshape(scores.shape)


def local_contrast(scores: Tensor, strength: float, radius: int, first: Tensor | None = None) -> Tensor:
    """Each score divided by the mean score of the tokens within ``radius`` of it, to the power ``strength``:
    [..., n] -> [..., n] (the mean over the tokens that exist: fewer near either end). ``first`` ``[rows]`` (of a
    2-D ``scores``), when given: each row's tokens start at that column (right-aligned rows of different lengths,
    as decode-time scoring holds them; the columns before must be 0, and their results are meaningless).

    ``out[..., i] = scores[..., i] / mean(scores[..., i - radius : i + radius + 1]) ** strength``. Why RC wants it:
    RoPE makes a query's logits fall with distance on average, and the window's self logits Y are all at distances
    below w, so the cross logits of recent tokens beat Y more often than those of early ones: RC's scores carry a
    slow trend towards the prompt's end (SmolLM2, summaries of 2k tokens at 0.8: 63-72% of the last tenth kept, 6-8%
    of the middle; KVzip keeps about 18% everywhere). Dividing by the neighbourhood's mean removes the trend and
    keeps what stands out where it is (a needle among its sentences): 1 removes it fully, 0 leaves the scores as
    they are. Between them, because a model-wide budget compares scores across heads and layers: at 1 every head's
    scores average about 1 wherever it reads, so that comparison loses how strongly each head reads its part of the
    prompt (SmolLM2 at 0.9 loses every value); 0.5 keeps half of it (log score - 0.5 log mean). The means come
    from one cumulative sum (O(n) whatever the radius), in float64.
    """
    if strength == 0 or scores.shape[-1] == 0:
        return scores
    n = scores.shape[-1]
    flat = scores.reshape(-1, n).to(torch.float64)
    sums = F.pad(flat.cumsum(dim=-1), (1, 0))  # sums[:, j] = total of the first j scores
    index = torch.arange(n, device=scores.device)
    low, high = (index - radius).clamp_min(0), (index + radius + 1).clamp_max(n)
    if first is None:
        mean = (sums[:, high] - sums[:, low]) / (high - low)
    else:  # each row's own left edge (the zeros before it add nothing to the sums, but would to the counts)
        low = torch.maximum(low, first.unsqueeze(1)).clamp_max(n - 1)
        mean = (sums[:, high] - sums.gather(1, low)) / (high - low).clamp_min(1)
    # A neighbourhood of zeros holds only zeros: 0 / tiny stays 0.
    contrasted = flat / mean.clamp_min(torch.finfo(torch.float64).tiny).pow(strength)
    return contrasted.to(scores.dtype).reshape(scores.shape)


def chunk_mean(scores: Tensor, size: int, first: Tensor | None = None) -> Tensor:
    """Each score replaced by the mean of its chunk: ``size`` consecutive tokens counted from the first (a last,
    shorter chunk averages the tokens it has): [..., n] -> [..., n]. ``first`` ``[rows]`` (of a 2-D ``scores``),
    when given: each row's tokens start at that column (right-aligned rows of different lengths, as decode-time
    scoring holds them) and its chunks are counted from there; the columns before keep their values.

    Why RC may want it (ChunkKV's unit): a value the answer copies is several tokens (a number's digits), read one by
    one by the answer's own queries, not by the window's; scored by chunk, a head keeps or drops them together. No
    host synchronisation (a decode step's scoring runs it)."""
    if size == 1 or scores.shape[-1] == 0:
        return scores
    n = scores.shape[-1]
    flat = scores.reshape(-1, n)
    rows, chunks = flat.shape[0], -(-n // size)
    if first is None:  # every row's chunks aligned: sums over a [rows, chunks, size] view (8x faster than scatters)
        pad = chunks * size - n
        sums = F.pad(flat, (0, pad)).view(rows, chunks, size).sum(-1)
        counts = torch.full((chunks,), float(size), dtype=flat.dtype, device=flat.device)
        counts[-1] = size - pad
        return (sums / counts).repeat_interleave(size, dim=-1)[:, :n].reshape(scores.shape)
    start = first.to(torch.int64)
    column = torch.arange(n, device=scores.device) - start.unsqueeze(1)  # [rows, n]: position in the row's tokens
    real = column >= 0
    index = torch.arange(rows, device=scores.device).unsqueeze(1) * chunks + column.clamp_min(0) // size
    weight = real.to(flat.dtype)
    sums = flat.new_zeros(rows * chunks).index_add_(0, index.flatten(), torch.where(real, flat, 0.0).flatten())
    counts = flat.new_zeros(rows * chunks).index_add_(0, index.flatten(), weight.flatten())
    means = (sums / counts.clamp_min(1))[index]
    return torch.where(real, means, flat).reshape(scores.shape)


def value_weighted(scores: Tensor, value_norms: Tensor, power: float) -> Tensor:
    """Each score times the norm of its token's value to the power ``power``: [..., n] x [..., n] -> [..., n].

    Why: attention's output is ``sum_t a_t v_t``, so what evicting token t removes from a head's output is
    ``a_t * ||v_t||``, not ``a_t`` alone (VATP, CriticalKV). A score measures ``a_t``'s side; weighting it by the
    value's norm ranks the tokens by their share of the output. +inf (kept) stays +inf; a zero value counts as a
    tiny one, so a score is never multiplied by 0 (nor +inf into NaN).
    """
    if power == 0:
        return scores
    return scores * value_norms.to(scores.dtype).clamp_min(1e-12).pow(power)


#: Cache dtypes the Triton scoring kernels take (tensor-core dots on 16-bit inputs, IEEE products on float32);
#: others (fp8 caches, float64 in tests) score in torch.
PAGED_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class PagedPrompt:
    """One request's prompt in a paged KV cache, to be read in place.

    Attributes:
        keys, values: [num_blocks, Hkv, block_size, d] cache views (strided views are fine: e.g. the key and
            value halves of vLLM's fused ``[num_blocks, Hkv, block_size, 2d]`` rows), or tiled views that only
            the torch gather reads (vLLM-CPU's AMX tiles, see :mod:`rcstat_vllm.kernels.paged`).
        block_table:  [pages] the request's block ids in token order (may be longer than the prompt needs).
        num_tokens:   n, the prompt tokens to score.
    """

    keys: Tensor
    values: Tensor
    block_table: Tensor
    num_tokens: int

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    def gather_keys(self) -> Tensor:
        """[Hkv, n, d] float32 copy of the prompt's keys (the torch path)."""
        return gather_paged_tokens(self.keys, self.block_table, 0, self.num_tokens, torch.float32)

    def gather_values(self) -> Tensor:
        """[Hkv, n, d_v] float32 copy of the prompt's values (only for scorers that read them)."""
        return gather_paged_tokens(self.values, self.block_table, 0, self.num_tokens).float()

    def value_norms(self) -> Tensor:
        """[Hkv, n] float32 norms of the prompt's values (a value-weighted scorer's only read of them), normed page by
        page where they lie (:func:`~rcstat_vllm.kernels.paged.paged_token_norms`)."""
        return paged_token_norms(self.values, self.block_table, 0, self.num_tokens)

    @property
    def kernel_dtype(self) -> bool:
        """Whether the Triton kernels take this cache's dtype."""
        return self.keys.dtype in PAGED_KERNEL_DTYPES

    @property
    def block_size(self) -> int:
        return paged_block_size(self.keys)

    def tail(self, first_block: int) -> PagedPrompt:
        """The prompt from block ``first_block`` on: the same cache, read from that block's first token."""
        return PagedPrompt(
            self.keys, self.values, self.block_table[first_block:], self.num_tokens - first_block * self.block_size
        )


@dataclass(eq=False)
class Scorer(ABC):
    """Scores every prompt token of one layer, per KV head. Subclasses are dataclasses: their fields are the
    method's knobs (:meth:`options`), validated in ``__post_init__``.

    Attributes:
        window_size: how many trailing prompt queries :meth:`score` needs (0 = none; None = the method's
            ``default_window_size``, its registry line's ``window``). Given fewer (short prompt), a scorer uses what
            it gets; given more, it uses the last ``window_size``.
        name: registry name (its line in :data:`rcstat_vllm.scoring.registry.REGISTRY`).
        needs_keys, needs_values: whether :meth:`score` reads the prompt's keys / values; :meth:`score_paged`
            gathers nothing else. ``needs_values`` and ``needs_value_norms`` are properties (a scorer's knobs decide):
            a scorer that reads only the values' norms (RC weighted by them) is given those instead
            (:meth:`_paged_values`).
    """

    name: ClassVar[str]
    default_window_size: ClassVar[int] = 0
    needs_keys: ClassVar[bool] = True
    #: whether a KV head's scores depend only on its own queries, keys and values: then :meth:`score_layers` stacks
    #: several layers' heads into one :meth:`score` call (TOVA averages a layer's heads; random draws per call)
    heads_independent: ClassVar[bool] = False

    # None until __post_init__ resolves it to the method's default: an int from then on (what the methods read).
    window_size: int = None  # type: ignore[assignment]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        # The published window is defined once, on the method's registry line (the torch-free settings read it
        # there); a scorer with no line (a test's own) keeps the one it declares.
        line = REGISTRY.get(getattr(cls, "name", ""))
        if line is not None:
            cls.default_window_size = line.window

    def __post_init__(self) -> None:
        requested = self.window_size
        self.window_size = self.default_window_size if requested is None else int(requested)
        if self.window_size < 0:
            raise ValueError(f"window_size must be >= 0, got {requested}")
        self._check_knobs()

    def _check_knobs(self) -> None:
        """Each field its registry line declares a knob for (its own, or a general setting it shares) is checked by
        that declaration: the config and the scorer allow the same values (a ConfigError, a ValueError, naming it)."""
        line = REGISTRY.get(getattr(self, "name", ""))
        if line is None:
            return
        for knob in line.knobs:
            if knob.option is not None:
                knob.check(getattr(self, knob.option))
        for option, knob in line.shared:
            knob.check(getattr(self, option))

    @property
    def needs_values(self) -> bool:
        """Whether :meth:`score` reads the prompt's values (None is passed otherwise). No method reads them by default;
        a value-aware scorer overrides this."""
        return False

    @property
    def needs_value_norms(self) -> bool:
        """Whether :meth:`score` reads only the norms of the prompt's values (over their last dim): from a paged cache
        it is then given ``[Hkv, n, 1]`` values holding the norms (:meth:`_paged_values`)."""
        return False

    @property
    def reads_values(self) -> bool:
        """Whether :meth:`score` reads the values at all (whole or their norms): else it is given None."""
        return self.needs_values or self.needs_value_norms

    def _paged_values(self, prompt: PagedPrompt) -> Tensor | None:
        """What :meth:`score` is given as values from a paged prompt: None when it reads none; the values gathered
        (``needs_values``); or, for a scorer that reads only their norms, ``[Hkv, n, 1]`` of the norms, each a vector
        of one entry whose norm is itself (the same scores; normed page by page where the values lie, ``d`` times
        less copied than the gather: :meth:`PagedPrompt.value_norms`)."""
        if self.needs_values:
            return prompt.gather_values()
        if self.needs_value_norms:
            return prompt.value_norms().unsqueeze(-1)
        return None

    @classmethod
    def options(cls) -> tuple[str, ...]:
        """The method's knobs: the keyword arguments its constructor takes."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    @abstractmethod
    def score(self, q_window: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        """Importance of every prompt token for every KV head.

        Args:
            q_window: [Hq, w, d] queries of the last w prompt positions (RoPE applied).
            keys:     [Hkv, n, d] prompt keys (RoPE applied). values: [Hkv, n, d_v].
                      From :meth:`score_paged`: keys [Hkv, n, 0] if not ``needs_keys``, values None if not
                      ``needs_values``.
            scale:    the layer's softmax scale (1/sqrt(d) usually); used by softmax-based methods.
        Returns:
            float32 [Hkv, n], higher = more important, +inf = always kept.
        """

    def score_ragged(
        self, q_window: Tensor, keys: Tensor, values: Tensor | None, lengths: list[int], scale: float
    ) -> Tensor:
        """:meth:`score` of each KV head alone over its own entries, when heads hold different numbers of them
        (decode-time compression): head ``h``'s are the last ``lengths[h]`` of ``keys[h]`` / ``values[h]``
        ``[Hkv, n, d]`` (right-aligned; the columns before are padding). Returns ``[Hkv, n]`` laid out as the keys:
        head ``h``'s last ``lengths[h]`` columns are the scores :meth:`score` gives that head alone, the columns before
        -inf. One call per head here; a scorer whose per-token statistics do not depend on the other tokens batches
        the heads."""
        group = q_window.shape[0] // keys.shape[0]
        n = keys.shape[1]
        out = torch.full((keys.shape[0], n), float("-inf"), dtype=torch.float32, device=keys.device)
        for head, length in enumerate(lengths):  # (host lengths: no read of the device)
            out[head, n - length :] = self.score(
                q_window[head * group : (head + 1) * group],
                keys[head : head + 1, n - length :],
                None if values is None else values[head : head + 1, n - length :],  # type: ignore[arg-type]
                scale,
            )[0]
        return out

    def score_paged(self, q_window: Tensor, prompt: PagedPrompt, scale: float, use_triton: bool = False) -> Tensor:
        """:meth:`score` of a prompt read from a paged cache: same arguments and result, ``prompt`` for keys/values.

        ``use_triton`` is the caller's go-ahead for the Triton kernels (the cache is where they run: a CUDA device,
        or the interpreter in tests); the scorer then takes its kernel if it has one that computes exactly its
        scores (:meth:`scores_in_triton`). Otherwise it gathers the keys (and values only if it reads them) into
        float32 copies for :meth:`score`.
        """
        if self.scores_in_triton(prompt, use_triton):
            return self._score_paged_triton(q_window, prompt, scale)
        keys = prompt.gather_keys() if self.needs_keys else self._key_placeholder(prompt)
        # (values None unless the scorer reads_values)
        return self.score(q_window.float(), keys, self._paged_values(prompt), scale)  # type: ignore[arg-type]

    def score_layers(self, q_windows: list[Tensor], prompts: list[PagedPrompt], scale: float) -> list[Tensor]:
        """:meth:`score_paged` (torch path) of one request's prompt in several layers at once, each layer's
        ``q_windows[i]`` against ``prompts[i]`` (the same tokens of every layer's cache, one softmax ``scale``).

        Why: a deferred scoring (lazy eviction) scores every layer in the step that compacts the request, and on a
        CPU a layer's few dozen small ops cost more in dispatch than in arithmetic; with :attr:`heads_independent`
        the layers' heads are stacked (``[L * Hkv, n, d]`` keys, ``[L * Hq, w, d]`` queries: layer-major, so each KV
        head keeps its own G query heads) and scored by one :meth:`score` call: the scores :meth:`score_paged` gives
        each layer, one layer after another."""
        if not self.heads_independent or len(prompts) < 2:
            return [self.score_paged(q, prompt, scale) for q, prompt in zip(q_windows, prompts, strict=True)]
        keys = torch.cat(
            [prompt.gather_keys() if self.needs_keys else self._key_placeholder(prompt) for prompt in prompts]
        )
        read = [self._paged_values(prompt) for prompt in prompts]
        values = torch.cat([v for v in read if v is not None]) if read[0] is not None else None
        queries = torch.cat([q.float() for q in q_windows])
        scores = self.score(queries, keys, values, scale)  # type: ignore[arg-type]
        return list(scores.split([prompt.num_kv_heads for prompt in prompts]))

    def scored_from(self, first_token: int, num_tokens: int, num_queries: int) -> int:
        """The first of ``num_tokens`` prompt tokens this scorer must read for every score from ``first_token`` on to be
        the one scoring the whole prompt gives (the tokens before are kept whatever they score: a prefix served from
        the prefix cache), with ``num_queries`` window queries. 0 here: a score that depends on the other tokens (a
        softmax over them) or on absolute positions needs them all."""
        return 0

    def scores_in_triton(self, prompt: PagedPrompt, use_triton: bool) -> bool:
        """The path :meth:`score_paged` takes: True = the Triton kernel, False = gather + :meth:`score`."""
        return bool(use_triton) and self.triton_kernel_applies(prompt)

    def triton_kernel_applies(self, prompt: PagedPrompt) -> bool:
        """Whether a Triton paged kernel computes this scorer's scores for ``prompt`` (none by default)."""
        return False

    def _score_paged_triton(self, q_window: Tensor, prompt: PagedPrompt, scale: float) -> Tensor:
        raise NotImplementedError(f"{self.name} has no Triton paged kernel")

    def head_pages_kernel_applies(self, key_cache: Tensor, num_queries: int, counts: Tensor) -> bool:
        """Whether a Triton kernel computes :meth:`score_ragged` for heads held in head pages (decode-time
        compression: :meth:`score_head_pages`), for this cache, ``num_queries`` window queries and each head's
        ``counts`` entries (host ints). None by default: the worker gathers the entries and calls
        :meth:`score_ragged`."""
        return False

    def score_head_pages(
        self, q_window: Tensor, key_cache: Tensor, pages: Tensor, starts: Tensor, counts: Tensor, scale: float
    ) -> Tensor:
        """:meth:`score_ragged` (its right-aligned ``[Hkv, max(counts)]``) of each KV head's entries ``starts[h] ..
        starts[h] + counts[h] - 1`` read in place from its head pages ``pages[h]`` of ``key_cache`` ``[num_blocks, Hkv,
        block_size, d]`` (see :mod:`rcstat_vllm.kernels.decode_scoring`), by a Triton kernel (where
        :meth:`head_pages_kernel_applies`)."""
        raise NotImplementedError(f"{self.name} has no Triton head-page kernel")

    @staticmethod
    def _key_placeholder(prompt: PagedPrompt) -> Tensor:
        """[Hkv, n, 0]: the shape and device position-only scorers use, without reading the cache."""
        return prompt.keys.new_empty(prompt.num_kv_heads, prompt.num_tokens, 0, dtype=torch.float32)

    def _window_length(self, num_queries: int, num_tokens: int) -> int:
        """w' = min(w, window_size, n): the trailing queries a windowed method uses."""
        w = min(num_queries, self.window_size, num_tokens)
        if w < 1:
            raise ValueError(f"{self.name} scoring needs at least one window query")
        return w

    def _trailing_window(self, q_window: Tensor, keys: Tensor) -> Tensor:
        """The last min(w, window_size) queries, grouped per KV head: [Hkv, G, w', d]."""
        if keys.dim() != 3 or q_window.dim() != 3:
            raise ValueError(
                f"expected q_window [Hq, w, d] and keys [Hkv, n, d], got "
                f"{tuple(q_window.shape)} and {tuple(keys.shape)}"
            )
        w = self._window_length(q_window.shape[1], keys.shape[1])
        return group_queries(q_window[:, q_window.shape[1] - w :], keys.shape[0])

    def _paged_window(self, q_window: Tensor, prompt: PagedPrompt) -> Tensor:
        """The same trailing queries as :meth:`_trailing_window`, ungrouped [Hq, w', d] as the kernels take them."""
        if q_window.dim() != 3:
            raise ValueError(f"expected q_window [Hq, w, d], got {tuple(q_window.shape)}")
        w = self._window_length(q_window.shape[1], prompt.num_tokens)
        return q_window[:, q_window.shape[1] - w :]
