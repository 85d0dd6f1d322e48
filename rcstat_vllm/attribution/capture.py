"""The narrow interface between the attention backend and attribution: per step, which batch rows asked;
per layer, their post-RoPE q/k into each request's :class:`~rcstat_vllm.attribution.trace.AttributionTrace`.

One :class:`AttributionCapture` per worker process (:func:`attribution_capture`). It is inert until the
attribution logits processor is constructed in that process (``RCStatAttributionProcessor.__init__`` calls
:meth:`AttributionCapture.activate`): before that, and for every step in which no request asked,
:meth:`AttributionCapture.plan` returns None after one attribute check, and the backend records nothing.

Backend wiring (the step plan in ``rcstat_vllm/worker/driver.py``, then each backend)::

    # WorkerCompression.plan_step, after ``query_start = ...``:
    plan.attribution = attribution_capture().plan(step.requests, query_start, self.num_layers)
    # each backend's forward, before its attention:
    record_layer(plan.attribution, layer_index, query, key)

The q/k are recorded before compaction touches the cache, so attribution sees every prompt key even when
the same request is compressed (compression changes which keys the model attends to afterwards, and so
the generated q/k, but attribution scores the keys as computed).

Results leave the worker through :func:`worker_results` (``RCStatWorkerExtension.rcstat_attribution_results``
calls it), where traces are finalized (top-k heads chosen, everything else dropped) and removed.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from rcstat_vllm.attribution.head_weights import HeadWeights
from rcstat_vllm.attribution.options import AttributionOptions
from rcstat_vllm.attribution.trace import AttributionTrace
from rcstat_vllm.config import ConfigError
from rcstat_vllm.log import logger

__all__ = [
    "PRESENTATION_KEYS",
    "REQUEST_KEY",
    "AttributionCapture",
    "AttributionWorkerMixin",
    "CaptureRow",
    "attribution_capture",
    "parse_request_options",
    "trace_id",
    "worker_results",
]

#: Key of the per-request switch in ``SamplingParams.extra_args`` (``vllm_xargs`` over HTTP).
REQUEST_KEY = "rcstat_attribution"

#: Per-request keys used by the client when it builds the result (not by the worker).
PRESENTATION_KEYS = {
    "spans": ("sentences", "chunks", "tokens"),
    "chunks": None,
    "generated_spans": ("sentences", "all"),
    "top": None,
}

#: Traces kept per worker, and their total bytes: beyond either, the least recently active traces are dropped
#: (finished requests whose results nobody read go first; a running request is never dropped in its own step).
MAX_TRACES = 256
MAX_BYTES = 1 << 30
#: Steps between two byte-budget checks (the check walks every trace's tensors).
_BUDGET_CHECK_EVERY = 32


def parse_request_options(value: Any) -> tuple[AttributionOptions, dict[str, Any]] | None:
    """The request's attribution setting -> (trace options, presentation options), or None when off.

    Accepted: absent / None / False / 0 (off), True / 1 (defaults), or a dict (or its JSON text) of
    :class:`AttributionOptions` fields plus ``spans`` (sentences | chunks | tokens), ``chunks`` (list of strings or
    [start, end] pairs), ``generated_spans`` (sentences | all) and ``top`` (int >= 1). ``{"enabled": false}`` is off
    too. Raises :class:`~rcstat_vllm.config.ConfigError` naming the bad field.
    """
    if isinstance(value, str):  # over HTTP, vllm_xargs values are scalars: the object travels as JSON text
        text = value.strip()
        if text.lower() in ("true", "1", "on"):
            value = True
        elif text.lower() in ("false", "0", "off", ""):
            value = False
        else:
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(REQUEST_KEY, value, f"true, false or a JSON object ({exc})") from None
    elif isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        value = bool(value)
    if value is None or value is False:
        return None
    if value is True:
        return AttributionOptions(), {}
    if not isinstance(value, Mapping):
        raise ConfigError(REQUEST_KEY, value, "true, false or a JSON object of attribution options")
    values = dict(value)
    enabled = values.pop("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError("enabled", enabled, "true or false")
    presentation = {key: values.pop(key) for key in list(values) if key in PRESENTATION_KEYS}
    for key, allowed in PRESENTATION_KEYS.items():
        if key in presentation and allowed is not None and presentation[key] not in allowed:
            raise ConfigError(key, presentation[key], " | ".join(allowed))
    if "top" in presentation and (
        not isinstance(presentation["top"], int) or isinstance(presentation["top"], bool) or presentation["top"] < 1
    ):
        raise ConfigError("top", presentation["top"], "an integer >= 1")
    if "chunks" in presentation:
        chunks = presentation["chunks"]
        if not isinstance(chunks, (list, tuple)) or not all(
            isinstance(c, str) or (isinstance(c, (list, tuple)) and len(c) == 2) for c in chunks
        ):
            raise ConfigError("chunks", chunks, "a list of strings or [start, end] character ranges")
    if presentation.get("spans") == "chunks" and not presentation.get("chunks"):
        raise ConfigError("chunks", presentation.get("chunks"), "a non-empty list when spans is 'chunks'")
    options = AttributionOptions.from_dict(values)
    return (options, presentation) if enabled else None


@dataclass(frozen=True)
class CaptureRow:
    """One batch row of a request that asked: its trace, its rows in the step's q/k, its first position."""

    trace: AttributionTrace
    row_start: int
    row_end: int
    position: int


class AttributionCapture:
    def __init__(self, max_traces: int = MAX_TRACES, max_bytes: int = MAX_BYTES):
        self.active = False
        self.max_traces = max_traces
        self.max_bytes = max_bytes
        self.traces: OrderedDict[str, AttributionTrace] = OrderedDict()
        self.evicted = 0
        self._steps = 0
        #: the model's calibrated attribution heads (None: the RC ranking), loaded once at activation
        self.calibration: HeadWeights | None = None

    def activate(self, model_dir: str | None = None) -> None:
        """Start capturing; ``model_dir`` (the served model's folder) is where its calibration file is looked for
        (:func:`rcstat_vllm.attribution.head_weights.load_head_weights`; absent = the RC ranking)."""
        if not self.active and model_dir is not None:
            from rcstat_vllm.attribution.head_weights import calibration_path, load_head_weights

            self.calibration = load_head_weights(model_dir)
            if self.calibration is not None:
                logger.info(
                    "rcstat: attribution scores with %d calibrated heads (%s)",
                    len(self.calibration.heads),
                    next(str(p) for p in calibration_path(model_dir) if p.exists()),
                )
        self.active = True

    # ---- the backend's calls ----

    def plan(self, requests: Sequence, query_start: Sequence[int], num_layers: int) -> list[CaptureRow] | None:
        """Rows of this step's batch to record (None when no request asked: the backend does nothing).

        Args:
            requests: the batch rows in attention-metadata order (``rcstat_vllm.worker.step.BatchRequest``: req_id,
                num_prompt_tokens, num_computed_tokens, extra_args).
            query_start: row r's tokens are query rows query_start[r] .. query_start[r + 1] - 1.
            num_layers: attention layers of the model (as the backend numbers them).
        """
        if not self.active:
            return None
        rows = None
        for index, request in enumerate(requests):
            extra = request.extra_args
            if not extra or REQUEST_KEY not in extra:
                continue
            trace = self.traces.get(request.req_id)
            if trace is None:
                try:
                    parsed = parse_request_options(extra[REQUEST_KEY])
                except ConfigError:
                    parsed = None  # validated at admission; never fail a batch over it
                if parsed is None:
                    continue
                trace = self._new_trace(request.req_id, request.num_prompt_tokens, num_layers, parsed[0])
                # Keys of tokens computed before the first traced step (a prefix-cache hit) never pass by.
                trace.missing_prompt_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
            else:
                self.traces.move_to_end(request.req_id)
            rows = rows or []
            rows.append(CaptureRow(trace, query_start[index], query_start[index + 1], request.num_computed_tokens))
        if rows is not None:
            self._steps += 1
            if self._steps % _BUDGET_CHECK_EVERY == 0:
                self._enforce_bytes(keep={id(row.trace) for row in rows})
        return rows

    def record(self, layer_index: int, rows: Sequence[CaptureRow], query: Tensor, key: Tensor | None) -> None:
        """One layer of one step: query [T, Hq, D], key [T, Hkv, D] of the whole batch (post-RoPE)."""
        if key is None:
            return
        for row in rows:
            if row.row_end > row.row_start:
                row.trace.record(
                    layer_index, row.position, query[row.row_start : row.row_end], key[row.row_start : row.row_end]
                )

    # ---- traces ----

    def _new_trace(
        self, req_id: str, num_prompt_tokens: int, num_layers: int, options: AttributionOptions
    ) -> AttributionTrace:
        trace = AttributionTrace(num_prompt_tokens, num_layers, options, calibration=self.calibration)
        self.traces[req_id] = trace
        while len(self.traces) > self.max_traces:
            dropped, _ = self.traces.popitem(last=False)
            self.evicted += 1
            logger.warning("rcstat: attribution trace of %s dropped (more than %d traces)", dropped, self.max_traces)
        return trace

    def _enforce_bytes(self, keep: set[int]) -> None:
        total = self.nbytes()
        for req_id in list(self.traces):
            if total <= self.max_bytes:
                break
            trace = self.traces[req_id]
            if id(trace) in keep:
                continue
            total -= trace.nbytes()
            del self.traces[req_id]
            self.evicted += 1
            logger.warning("rcstat: attribution trace of %s dropped (traces over %d bytes)", req_id, self.max_bytes)

    def find(self, req_id: str) -> tuple[str, AttributionTrace] | None:
        """The trace of ``req_id`` (exact, or an engine id that ``req_id`` prefixes: ``<id>-<suffix>``)."""
        if req_id in self.traces:
            return req_id, self.traces[req_id]
        for key, trace in self.traces.items():
            if key.startswith(f"{req_id}-"):
                return key, trace
        return None

    def nbytes(self) -> int:
        return sum(t.nbytes() for t in self.traces.values())

    def clear(self) -> None:
        self.traces.clear()


def trace_id(request_id: str, index: int, num_choices: int) -> str:
    """The id the workers' traces are found by: the request's own id, or vLLM's child id ``<i>_<id>`` when
    ``n > 1`` (``AttributionCapture.find`` also matches the engine's ``-<suffix>``)."""
    return str(request_id) if num_choices <= 1 else f"{index}_{request_id}"


_CAPTURE = AttributionCapture()


def attribution_capture() -> AttributionCapture:
    """This process's capture (one per worker process)."""
    return _CAPTURE


def worker_results(
    req_id: str,
    prompt_ranges: Sequence[Sequence[int]],
    generated_ranges: Sequence[Sequence[int]],
    pop: bool = True,
) -> dict[str, Any] | None:
    """Eq. 10 for ``generated_ranges`` (token ranges of the generation) over ``prompt_ranges`` (token ranges
    of the prompt) for request ``req_id``; None if this worker has no trace of it. JSON-able."""
    from rcstat_vllm.attribution.report import score_spans

    capture = attribution_capture()
    found = capture.find(req_id)
    if found is None:
        return None
    key, trace = found
    result = score_spans(trace, prompt_ranges, generated_ranges, prune=True)
    result["req_id"] = key
    if pop:
        capture.traces.pop(key, None)
    return result


class AttributionWorkerMixin:
    """Worker-extension methods (mixed into ``rcstat_vllm.api.RCStatWorkerExtension``)."""

    def rcstat_attribution_results(self, req_id, prompt_ranges, generated_ranges, pop=True):
        return worker_results(req_id, prompt_ranges, generated_ranges, pop)


def record_layer(rows, layer_index: int, query, key) -> None:
    """Before a layer's attention: hand its queries/keys to the capture when requests of this step asked
    (``rows``: the step plan's ``attribution``, None or empty when none did)."""
    if rows:
        attribution_capture().record(layer_index, rows, query, key)
