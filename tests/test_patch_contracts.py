"""The contracts of patches/: every private vLLM API the plugin touches exists, with the expected signature,
in the installed vLLM; a broken contract fails with a message naming the symbol and the pinned version;
the hooks install once however often vLLM calls ``register()``."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm")

import vllm

from rcstat_vllm import plugin
from rcstat_vllm.patches import (
    MODULES,
    Contract,
    VLLMContractError,
    all_contracts,
    check_contracts,
)
from rcstat_vllm.patches._contract import PINNED_VLLM, wrap_method

CONTRACTS = all_contracts()


def test_installed_vllm_is_the_pinned_version():
    assert vllm.__version__.startswith(PINNED_VLLM + "."), vllm.__version__


def test_every_patch_module_declares_contracts():
    assert len(MODULES) >= 4
    for module in MODULES:
        assert module.CONTRACTS, f"{module.__name__} has no CONTRACTS"


@pytest.mark.parametrize("contract", CONTRACTS, ids=[c.target for c in CONTRACTS])
def test_contract_holds_on_installed_vllm(contract):
    if not contract.applies():
        pytest.skip(f"{contract.platform}-only symbol: vLLM's {contract.platform} build is not installed here")
    assert contract.check() is not None


def test_cpu_build_checks_the_flashattention_classes_the_cuda_backend_extends():
    """Only the CUDA kernels' contracts are left to CUDA builds; the classes are checked here."""
    flash = [c for c in CONTRACTS if "backends.flash_attn:" in c.target]
    assert len(flash) >= 4 and all(c.applies() for c in flash)
    cuda_only = {c.target.rsplit(":", 1)[1] for c in CONTRACTS if c.platform == "cuda"}
    assert {"flash_attn_varlen_func", "reshape_and_cache_flash"} <= cuda_only
    assert not any(c.applies() for c in CONTRACTS if c.platform == "cuda")  # this is vLLM's CPU build


def test_check_contracts():
    check_contracts()


def test_missing_module_names_symbol_and_version():
    contract = Contract("vllm.no_such_module:Thing.method")
    with pytest.raises(VLLMContractError) as info:
        contract.check()
    message = str(info.value)
    assert "vllm.no_such_module:Thing.method" in message
    assert "is missing" in message
    assert PINNED_VLLM in message and vllm.__version__ in message


def test_missing_attribute_names_symbol_and_version():
    contract = Contract("vllm.platforms.cpu:CpuPlatform.no_such_hook", ("cls",))
    with pytest.raises(VLLMContractError) as info:
        contract.check()
    message = str(info.value)
    assert "CpuPlatform.no_such_hook" in message
    assert PINNED_VLLM in message and vllm.__version__ in message


def test_wrong_parameters_name_symbol_expected_and_version():
    contract = Contract("vllm.v1.core.sched.scheduler:Scheduler.update_from_output", ("self", "renamed_output"))
    with pytest.raises(VLLMContractError) as info:
        contract.check()
    message = str(info.value)
    assert "Scheduler.update_from_output" in message
    assert "renamed_output" in message and "scheduler_output" in message
    assert PINNED_VLLM in message and vllm.__version__ in message


def test_wrong_classmethod_parameters_are_caught():
    contract = Contract("vllm.platforms.cpu:CpuPlatform.check_and_update_config", ("cls", "config"))
    with pytest.raises(VLLMContractError, match="check_and_update_config"):
        contract.check()


def _counting_wrapper(calls: list):
    def make(original):
        def wrapper(*args, **kwargs):
            calls.append(args)
            return original(*args, **kwargs)

        return wrapper

    return make


def test_wrap_method_is_idempotent():
    class Target:
        def method(self, x):
            return x + 1

    calls: list = []
    wrap_method(Target, "method", _counting_wrapper(calls))
    wrap_method(Target, "method", _counting_wrapper(calls))
    assert Target().method(1) == 2
    assert len(calls) == 1
    assert Target.method.__name__ == "method"


def test_wrap_method_classmethod_is_idempotent():
    class Target:
        @classmethod
        def build(cls, x):
            return (cls, x)

    calls: list = []
    for _ in range(3):
        wrap_method(Target, "build", _counting_wrapper(calls))
    assert Target.build(5) == (Target, 5)
    assert isinstance(Target.__dict__["build"], classmethod)
    assert len(calls) == 1 and calls[0][0] is Target


def test_wrap_method_inherited_classmethod_stays_a_classmethod_of_the_subclass():
    class Parent:
        @classmethod
        def build(cls, x):
            return (cls, x)

    class Child(Parent):
        pass

    calls: list = []
    wrap_method(Child, "build", _counting_wrapper(calls))
    assert isinstance(Child.__dict__["build"], classmethod)
    assert Child.build(1) == (Child, 1)  # not bound to Parent
    assert Parent.build(2) == (Parent, 2)  # the parent is untouched
    assert len(calls) == 1 and calls[0][0] is Child


def test_wrap_method_names_a_missing_attribute():
    class Target:
        pass

    with pytest.raises(AttributeError, match="method"):
        wrap_method(Target, "method", _counting_wrapper([]))


def _wrap_depth(func) -> int:
    """How many rcstat wrappers are stacked on ``func``."""
    depth = 0
    while getattr(func, "__rcstat_wrapped__", False):
        depth += 1
        func = func.__wrapped__
    return depth


def test_register_is_idempotent():
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.input_processor import InputProcessor

    plugin.register()
    plugin._registered = False  # as if a fresh import ran register() again in the same process
    plugin.register()
    plugin.register()
    hooked = [
        CpuPlatform.__dict__["get_attn_backend_cls"].__func__,
        CpuPlatform.__dict__["check_and_update_config"].__func__,
        InputProcessor.__dict__["_validate_params"],
        Scheduler.__dict__["update_from_output"],
    ]
    assert [_wrap_depth(f) for f in hooked] == [1, 1, 1, 1]
    # The contracts still see vLLM's own signatures through the wrappers.
    check_contracts()


#: private vLLM names the package may read only through rcstat_vllm/vllm_private/internals.py (or a hook in patches/),
#: as read (an attribute, a getattr string, an import)
PRIVATE_NAMES = {
    "_custom_ops": r"_custom_ops",
    "_k_scale / _v_scale": r"\._[kv]_scale",
    "static_forward_context": r"[.\"']static_forward_context",
    "kv_sharing_target_layer_name": r"[.\"']kv_sharing_target_layer_name",
    "kv_offloading_size": r"[.\"']kv_offloading_size",
    "_set_isa_to_layers": r"_set_isa_to_layers",
    "sinks": r"[.\"']sinks\b",
    "TP group": r"get_tp_group|[.\"']cpu_group",
}
#: reads not yet switched to the adapter (file -> names)
NOT_YET_SWITCHED: dict[str, set[str]] = {}


def _package_sources():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for folder in ("rcstat_vllm", "kernels"):
        for path in sorted((root / folder).rglob("*.py")):
            yield path.relative_to(root).as_posix(), path.read_text()


def test_private_vllm_names_are_read_only_through_the_adapter():
    found = {}
    for name, text in _package_sources():
        if name == "rcstat_vllm/vllm_private/internals.py":
            continue
        hits = {private for private, pattern in PRIVATE_NAMES.items() if re.search(pattern, text)}
        hits -= NOT_YET_SWITCHED.get(name, set())
        if hits:
            found[name] = sorted(hits)
    assert found == {}


def test_the_package_never_imports_patches():
    """Patches import the package, never the reverse (the entry point aside)."""
    import ast

    importers = []
    for name, text in _package_sources():
        for node in ast.walk(ast.parse(text)):
            modules = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            if any(m == "rcstat_vllm.patches" or m.startswith("rcstat_vllm.patches.") for m in modules):
                importers.append(name)
    assert importers == ["rcstat_vllm/plugin.py"]


def test_install_all_hands_the_chat_hook_to_the_config_hook():
    from rcstat_vllm.patches import openai_chat, platform

    plugin.register()
    assert openai_chat.maybe_install in platform._AT_CONFIGURE
