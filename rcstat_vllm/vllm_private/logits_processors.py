"""vLLM's logits-processor interface, which the attribution switch implements
(``rcstat_vllm/attribution/processor.py``), and the validation error it raises for a bad request option.

Imported from here only, so that every private vLLM name the package reads sits in this adapter package (contracts in
:mod:`rcstat_vllm.vllm_private.internals`)."""

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor  # noqa: F401
from vllm.v1.sample.logits_processor.interface import MoveDirectionality  # noqa: F401

try:
    from vllm.exceptions import VLLMValidationError
except ImportError:  # pragma: no cover - older vLLM: a plain ValueError is what it reports as HTTP 400
    VLLMValidationError = None  # type: ignore[misc, assignment]
