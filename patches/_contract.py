"""Shared helpers for the patches: idempotent method wrapping; the contracts themselves are
:mod:`rcstat_vllm.vllm_private.contract` (re-exported here for the patch modules)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from rcstat_vllm.vllm_private.contract import PINNED_VLLM, Contract, VLLMContractError

__all__ = ["PINNED_VLLM", "Contract", "VLLMContractError", "is_wrapped", "wrap_method"]

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
