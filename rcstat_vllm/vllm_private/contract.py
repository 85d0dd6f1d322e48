"""Contracts: the private vLLM symbols the plugin relies on, checked against the installed vLLM.

Every private vLLM symbol the plugin touches is declared as a :class:`Contract`: by the hook modules in
``patches/`` and, for what the package reads itself, by :mod:`rcstat_vllm.vllm_private.internals`. ``check()`` runs them
when the plugin registers and in ``tests/test_patch_contracts.py``: a vLLM release that renamed or reshaped one
fails with a message naming the symbol, what was expected and the pinned version, instead of failing somewhere
deep inside a request.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any

PINNED_VLLM = "0.32"


class VLLMContractError(RuntimeError):
    """A private vLLM API the plugin relies on is missing or has changed."""


@dataclass(frozen=True)
class Contract:
    """``module:qualname`` must exist (and, if ``params`` is given, start with those parameter names).

    ``attrs``: attributes the plugin reads on instances of that class; each must be declared by the class or a
    base: a class attribute, a dataclass or pydantic field, an annotation, or assigned as ``self.<name> =`` in
    the class's source (instance attributes exist only on instances).

    ``platform`` ("cuda", "cpu") limits the contract to vLLM builds for that platform: vLLM's CPU wheel cannot
    import its CUDA kernels' modules, and the other way round.
    """

    target: str
    params: tuple[str, ...] | None = None
    platform: str | None = None
    attrs: tuple[str, ...] = ()

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
            problem = parameters_problem(tuple(inspect.signature(fn).parameters), self.params)
            if problem:
                raise VLLMContractError(self._message(problem))
        missing = [name for name in self.attrs if not _declares(obj, name)]
        if missing:
            raise VLLMContractError(self._message(f"declares no attribute {', '.join(missing)}"))
        return obj

    def _message(self, problem: str) -> str:
        import vllm

        return (
            f"rcstat-vllm: vLLM private API {self.target} {problem}. rcstat-vllm supports vLLM "
            f"{PINNED_VLLM}.x; installed vLLM is {vllm.__version__}."
        )


def parameters_problem(got: tuple[str, ...], expected: tuple[str, ...]) -> str | None:
    """What breaks a contract expecting ``expected`` in a callable whose parameter names are ``got`` (all of
    them, in order), or None: its first ``len(expected)`` names must be ``expected``. Shared with the check from
    source, ``tools/vllm_compat.py``."""
    head = tuple(got)[: len(expected)]
    return None if head == tuple(expected) else f"has parameters {head}, expected {tuple(expected)}"


def assigns_attribute(source: str, name: str) -> bool:
    """Whether a class's ``source`` assigns ``self.<name> =`` (an instance attribute; see :class:`Contract`)."""
    return re.search(rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=(?!=)", source) is not None


def _declares(cls: Any, name: str) -> bool:
    """Whether instances of ``cls`` carry attribute ``name`` (see :class:`Contract`)."""
    if hasattr(cls, name):
        return True
    for klass in getattr(cls, "__mro__", ()):
        declared = vars(klass)
        if name in declared.get("__annotations__", {}) or name in (declared.get("__dataclass_fields__") or {}):
            return True
        if name in (declared.get("model_fields") or {}):
            return True
        if not klass.__module__.startswith("vllm"):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if assigns_attribute(source, name):
            return True
    return False
