"""Shared helpers for the patches: contract checks and idempotent method wrapping.

Every patch declares the private vLLM symbols it touches as :class:`Contract` entries. ``check()`` runs
them at install time and in ``tests/test_patch_contracts.py``: a vLLM release that renamed or reshaped one
fails with a message naming the symbol, what was expected and the pinned version, instead of failing
somewhere deep inside a request.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

PINNED_VLLM = "0.32"


class VLLMContractError(RuntimeError):
    """A private vLLM API the plugin relies on is missing or has changed."""


@dataclass(frozen=True)
class Contract:
    """``module:qualname`` must exist (and, if ``params`` is given, start with those parameter names).

    ``platform`` ("cuda", "cpu") limits the contract to vLLM builds for that platform: vLLM's CPU wheel cannot
    import its CUDA kernels' modules, and the other way round.
    """

    target: str
    params: tuple[str, ...] | None = None
    platform: str | None = None

    def applies(self) -> bool:
        """Whether this contract concerns the platform vLLM runs on here."""
        if self.platform is None:
            return True
        from vllm.platforms import current_platform

        return {"cuda": current_platform.is_cuda, "cpu": current_platform.is_cpu}[self.platform]()

    def resolve(self) -> Any:
        module_name, _, qualname = self.target.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise VLLMContractError(self._message(f"is missing ({exc})")) from None
        return obj

    def check(self) -> Any:
        obj = self.resolve()
        if self.params is not None:
            # Classmethods resolve bound: compare the underlying function's parameters (cls included).
            fn = inspect.unwrap(obj.__func__ if inspect.ismethod(obj) else obj)
            got = tuple(inspect.signature(fn).parameters)[: len(self.params)]
            if got != self.params:
                raise VLLMContractError(
                    self._message(f"has parameters {got}, expected {self.params}")
                )
        return obj

    def _message(self, problem: str) -> str:
        import vllm

        return (
            f"rcstat-vllm: vLLM private API {self.target} {problem}. rcstat-vllm supports vLLM "
            f"{PINNED_VLLM}.x; installed vLLM is {vllm.__version__}."
        )


_WRAPPED_MARK = "__rcstat_wrapped__"


def is_wrapped(func) -> bool:
    """Whether ``func`` (a class attribute) is a hook installed by :func:`wrap_method`."""
    func = getattr(func, "__func__", func)
    return bool(getattr(func, _WRAPPED_MARK, False))


def wrap_method(owner: type, name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` by ``make_wrapper(original)``, once (idempotent across repeated installs).

    Works for plain methods and classmethods (the wrapper then receives ``cls`` first).
    """
    # The raw attribute (a ``classmethod`` object stays one) from the first class in the MRO defining it:
    # ``getattr`` would return an inherited classmethod already bound to the parent class.
    raw = next((klass.__dict__[name] for klass in owner.__mro__ if name in klass.__dict__), None)
    if raw is None:
        raise AttributeError(f"{owner.__qualname__} has no attribute {name!r}")
    func = raw.__func__ if isinstance(raw, classmethod) else raw
    if getattr(func, _WRAPPED_MARK, False):
        return
    wrapper = functools.wraps(func)(make_wrapper(func))
    setattr(wrapper, _WRAPPED_MARK, True)
    setattr(owner, name, classmethod(wrapper) if isinstance(raw, classmethod) else wrapper)
