"""tools/vllm_compat.py: contracts checked against a vLLM release's source read from its wheel, never imported.
A tiny fake wheel (a zip of a few .py files) and hand-made contracts; no network, no vLLM."""

from __future__ import annotations

import importlib.util
import json
import sys
import zipfile
from pathlib import Path

import pytest

from rcstat_vllm.vllm_private.contract import Contract

_TOOL = Path(__file__).resolve().parents[1] / "tools" / "vllm_compat.py"
_spec = importlib.util.spec_from_file_location("vllm_compat", _TOOL)
compat = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("vllm_compat", compat)
_spec.loader.exec_module(compat)

FILES = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '9.9.0'\n",
    "vllm/core/__init__.py": "from .engine import Engine\n",
    "vllm/core/base.py": """
class Base:
    shared: int = 0

    def __init__(self, config):
        self.config = config

    def step(self, batch, budget):
        pass
""",
    "vllm/core/engine.py": """
import enum
from dataclasses import dataclass

from .base import Base


class Status(enum.Enum):
    RUNNING = 1


@dataclass
class Spec:
    block_size: int
    layers: list


class Engine(Base):
    def __init__(self, config, device):
        super().__init__(config)
        self.requests: dict = {}

    def run(self, output, runner_output, *args):
        pass

    def renamed(self, scheduler_output):
        pass

    @classmethod
    def configure(cls, vllm_config):
        pass

    @property
    def ready(self):
        return True
""",
    "vllm/planning.py": """
def plan_groups(vllm_config, specs):
    pass
""",
}

CASES = {
    # target, params, attrs -> status
    "ok method": (Contract("vllm.core.engine:Engine.run", ("self", "output", "runner_output")), "ok"),
    "ok inherited method": (Contract("vllm.core.engine:Engine.step", ("self", "batch", "budget")), "ok"),
    "ok classmethod": (Contract("vllm.core.engine:Engine.configure", ("cls", "vllm_config")), "ok"),
    "ok property": (Contract("vllm.core.engine:Engine.ready"), "ok"),
    "ok enum member": (Contract("vllm.core.engine:Status.RUNNING"), "ok"),
    "ok re-export": (Contract("vllm.core:Engine.__init__", ("self", "config", "device")), "ok"),
    "ok attrs": (Contract("vllm.core.engine:Engine", attrs=("requests", "config", "shared", "run", "ready")), "ok"),
    "ok dataclass fields": (Contract("vllm.core.engine:Spec", attrs=("block_size", "layers")), "ok"),
    "missing method": (Contract("vllm.core.engine:Engine.gone", ("self",)), "missing"),
    "missing class": (Contract("vllm.core.engine:Scheduler"), "missing"),
    "missing module": (Contract("vllm.core.nowhere:Nothing"), "missing"),
    "module gone, class moved": (Contract("vllm.core.nowhere:Engine.run"), "moved to vllm.core.engine:Engine.run"),
    "missing enum member": (Contract("vllm.core.engine:Status.WAITING"), "missing"),
    "signature changed": (Contract("vllm.core.engine:Engine.renamed", ("self", "output")), "signature changed"),
    "signature changed, too few": (
        Contract("vllm.core.engine:Engine.run", ("self", "output", "runner_output", "x", "y")),
        "signature changed",
    ),
    "attribute missing": (Contract("vllm.core.engine:Spec", attrs=("block_size", "shared_by")), "attribute missing"),
    "moved": (Contract("vllm.core.engine:plan_groups", ("vllm_config", "specs")), "moved to vllm.planning:plan_groups"),
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wheel")
    path = folder / "vllm-9.9.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in FILES.items():
            archive.writestr(name, text)
        archive.writestr("vllm/_C.abi3.so", b"\0")
    return path


@pytest.fixture(scope="module")
def resolver(wheel) -> compat.Resolver:
    return compat.Resolver(compat.Source(wheel))


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_contract_status(resolver, case):
    contract, status = CASES[case]
    result = compat.check_contract(resolver, contract)
    assert result.status == status, result


def test_details_name_what_changed(resolver):
    changed = compat.check_contract(resolver, CASES["signature changed"][0])
    assert changed.details == "has parameters ('self', 'scheduler_output'), expected ('self', 'output')"
    line = FILES["vllm/core/engine.py"].splitlines().index("    def renamed(self, scheduler_output):") + 1
    assert changed.params == ["self", "scheduler_output"] and changed.where == f"vllm/core/engine.py:{line}"
    missing = compat.check_contract(resolver, CASES["missing method"][0])
    assert missing.details.startswith("vllm.core.engine:Engine.gone not found")
    close = compat.check_contract(resolver, Contract("vllm.core.engine:Engine.rnu"))
    assert "(close: run" in close.details
    attribute = compat.check_contract(resolver, CASES["attribute missing"][0])
    assert attribute.details == "declares no attribute shared_by"
    assert compat.check_contract(resolver, CASES["missing module"][0]).details == "module vllm.core.nowhere not found"


def test_the_runtime_rule_is_the_one_shared():
    """The parameter rule is contract.py's: the first names must match, extra trailing parameters are fine."""
    from rcstat_vllm.vllm_private.contract import assigns_attribute, parameters_problem

    assert parameters_problem(("self", "a", "b"), ("self", "a")) is None
    assert parameters_problem(("self", "b"), ("self", "a")) == "has parameters ('self', 'b'), expected ('self', 'a')"
    assert assigns_attribute("self.x: int = 1", "x") and assigns_attribute("self.x = 1", "x")
    assert not assigns_attribute("self.x == 1", "x") and not assigns_attribute("self.xy = 1", "x")


def test_imports_checked(resolver):
    rows = [
        ("a.py", 1, "vllm.core", "Engine"),
        ("a.py", 2, "vllm.core.engine", "Status"),
        ("a.py", 3, "vllm.core", "engine"),  # a submodule
        ("a.py", 4, "vllm.core.engine", "plan_groups"),
        ("a.py", 5, "vllm.core.engine", "Nothing"),
        ("a.py", 6, "vllm.gone", "Nothing"),
        ("a.py", 7, "vllm.gone", "Engine"),
        ("a.py", 8, "vllm.core.engine", None),
        ("a.py", 9, "vllm.gone", None),
    ]
    statuses = [compat.check_import(resolver, *row).status for row in rows]
    assert statuses == [
        "ok",
        "ok",
        "ok",
        "moved to vllm.planning:plan_groups",
        "missing",
        "missing",
        "moved to vllm.core.engine:Engine",
        "ok",
        "missing",
    ]


def test_package_imports_are_found():
    rows = compat.package_imports()
    assert rows and all(module.split(".")[0] == "vllm" for _, _, module, _ in rows)
    assert any(f.startswith("patches/") for f, _, _, _ in rows)


def test_command_writes_the_report_and_exits_0(wheel, tmp_path, capsys):
    contracts = [CASES["ok method"][0], CASES["missing class"][0], CASES["signature changed"][0]]
    out = tmp_path / "report.json"
    # a folder holding the wheel is read like the wheel
    assert compat.main(["--wheel", str(wheel.parent), "--json", str(out)], contracts=contracts, imports=[]) == 0
    data = json.loads(out.read_text())
    assert data["vllm_version"] == "9.9.0"
    assert data["summary"] == {
        "contracts": 3,
        "ok": 1,
        "broken": 2,
        "by_status": {"missing": 1, "ok": 1, "signature changed": 1},
        "imports": 0,
        "imports_ok": 0,
    }
    printed = capsys.readouterr().out
    assert "1 of 3 contracts hold" in printed and "vllm.core.engine:Scheduler" in printed


def test_unpacked_tree_reads_like_the_wheel(wheel, tmp_path):
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path)
    tree = compat.Resolver(compat.Source(tmp_path))
    for contract, status in CASES.values():
        assert compat.check_contract(tree, contract).status == status
