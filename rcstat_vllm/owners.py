"""Where the plugin's two long-lived owners are found from the vLLM objects the hooks wrap.

- one :class:`~rcstat_vllm.engine.block_exchange.EngineCompaction` per scheduler, created with it when the flag is on
  and found from its ``BlockPool``: the one object the scheduler and its KV cache managers (whose methods
  ``patches/scheduler.py`` wraps) share;
- one :class:`~rcstat_vllm.worker.driver.WorkerCompression` per model runner, created by the runner hook before vLLM
  builds the runner's attention backends (their metadata builders receive it, :func:`building_backends`) and found
  from the runner by the other runner hooks and the Python API.

vLLM gives a plugin no slot on its objects, and the plugin sets no attribute on them: each table maps the object to
its owner, weakly (an engine shut down takes its owner with it). These two tables are the package's only state that
outlives a call; only the patches (``patches/scheduler.py``, ``patches/model_runner.py``) and the API's worker
extension read them, and the modules below them are handed their owner.
"""

from __future__ import annotations

import weakref

from rcstat_vllm.config import RCStatConfig
from rcstat_vllm.engine.block_exchange import EngineCompaction
from rcstat_vllm.worker.driver import WorkerCompression, building_backends, new_worker_compression

__all__ = [
    "building_backends",
    "engine_owner",
    "runner_owner",
    "start_engine_owner",
    "start_runner_owner",
]

_ENGINE_OWNERS: weakref.WeakKeyDictionary[object, EngineCompaction] = weakref.WeakKeyDictionary()
_RUNNER_OWNERS: weakref.WeakKeyDictionary[object, WorkerCompression] = weakref.WeakKeyDictionary()


def start_engine_owner(block_pool, config: RCStatConfig, group: int | None) -> EngineCompaction:
    """The scheduler-side owner of the engine whose scheduler owns ``block_pool`` (``group``: the KV cache group it
    compresses, None for none)."""
    owner = _ENGINE_OWNERS[block_pool] = EngineCompaction(config=config, group=group)
    return owner


def engine_owner(block_pool) -> EngineCompaction | None:
    """The engine's owner; None when the engine runs without the flag."""
    return _ENGINE_OWNERS.get(block_pool)


def start_runner_owner(runner, kv_cache_groups=None) -> WorkerCompression | None:
    """A fresh owner for a model runner setting up its KV cache (a profiling set-up, then the real one: each starts
    anew); None when the flag is off (the runner's hooks pass through)."""
    owner = new_worker_compression(runner.vllm_config, kv_cache_groups)
    if owner is None:
        _RUNNER_OWNERS.pop(runner, None)
    else:
        _RUNNER_OWNERS[runner] = owner
    return owner


def runner_owner(runner) -> WorkerCompression | None:
    """The runner's owner; None when the engine runs without the flag."""
    return _RUNNER_OWNERS.get(runner)
