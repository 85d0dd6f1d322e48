"""The plugin's logger: a child of vLLM's ``vllm`` logger, so it shares vLLM's format, handlers and
``VLLM_LOGGING_LEVEL`` in every process (API server, engine core, workers)."""

import logging

logger = logging.getLogger("vllm.rcstat")
