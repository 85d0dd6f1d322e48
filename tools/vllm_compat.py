"""Check every vLLM contract of the plugin against another vLLM release's Python source, without installing it.

    python tools/vllm_compat.py --wheel /tmp/vllm033 [--json OUT]

``--wheel``: a vLLM wheel (``pip download vllm==0.33.0 --no-deps -d /tmp/vllm033``), a folder holding one, or an
unpacked source tree (a folder with ``vllm/__init__.py``, e.g. the installed vLLM's ``site-packages``). The wheel's
``.py`` files are read from the zip and parsed with :mod:`ast`; nothing of that vLLM is imported.

Each :class:`~rcstat_vllm.vllm_private.contract.Contract` (``rcstat_vllm.patches.all_contracts()``; collecting them
imports the installed vLLM, as the patch modules do) is looked up in the source: its module, then each part of its
qualname (module names, imports and re-exports followed, class bodies and their vLLM bases searched). A contract
is *ok*, *missing*, *moved to X* (its name is defined by another module, where it is then checked), *signature
changed* (the first parameter names differ: :func:`~rcstat_vllm.vllm_private.contract.parameters_problem`, the
runtime check's rule) or *attribute missing* (an ``attrs`` name the class does not declare: a class attribute,
method or annotation/field in its body or a vLLM base's, or ``self.<name> =`` in its source, as the runtime check's
:func:`~rcstat_vllm.vllm_private.contract.assigns_attribute`). Every ``vllm`` import in the package's own files
(``rcstat_vllm/``, ``patches/``, ``kernels/``) is checked the same way.

It is a report: the exit status is 0 whatever it finds (non-zero only if the tool itself fails).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import difflib
import json
import re
import sys
import zipfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rcstat_vllm.vllm_private.contract import assigns_attribute, parameters_problem  # noqa: E402

#: the package's folders whose ``vllm`` imports are checked
PACKAGE_FOLDERS = ("rcstat_vllm", "patches", "kernels")
#: functools caches: attributes a decorated function carries
_CACHE_DECORATORS = {"cache", "lru_cache", "functools.cache", "functools.lru_cache"}
_CACHE_ATTRS = {"cache_clear", "cache_info", "cache_parameters"}


# --------------------------------------------------------------------------------------------------- the source


class Source:
    """The ``.py`` files of a vLLM release: from a wheel (read in place) or an unpacked tree."""

    def __init__(self, path: str | Path):
        path = Path(path)
        self._zip: zipfile.ZipFile | None = None
        self._root: Path | None = None
        if path.is_dir() and (path / "vllm" / "__init__.py").is_file():
            self._root = path
        elif path.is_dir() and path.name == "vllm" and (path / "__init__.py").is_file():
            self._root = path.parent
        else:
            if path.is_dir():
                wheels = sorted(path.glob("vllm-*.whl"))
                if not wheels:
                    raise SystemExit(f"vllm_compat: no vllm-*.whl and no vllm/ source tree in {path}")
                path = wheels[-1]
            self._zip = zipfile.ZipFile(path)
        self.path = path
        if self._zip is not None:
            names = [n for n in self._zip.namelist() if n.startswith("vllm/") and n.endswith(".py")]
        else:
            assert self._root is not None
            names = [p.relative_to(self._root).as_posix() for p in (self._root / "vllm").rglob("*.py")]
        self.files = set(names)
        self._trees: dict[str, ast.Module | None] = {}
        self._texts: dict[str, str] = {}
        self.version = self._version()

    def text(self, name: str) -> str:
        if name not in self._texts:
            if self._zip is not None:
                raw = self._zip.read(name)
            else:
                assert self._root is not None
                raw = (self._root / name).read_bytes()
            self._texts[name] = raw.decode("utf-8", errors="replace")
        return self._texts[name]

    def module_file(self, module: str) -> str | None:
        """``vllm/a/b.py`` or ``vllm/a/b/__init__.py`` for module ``vllm.a.b``; None if the source has neither."""
        base = module.replace(".", "/")
        for name in (f"{base}.py", f"{base}/__init__.py"):
            if name in self.files:
                return name
        return None

    def is_package(self, module: str) -> bool:
        return (self.module_file(module) or "").endswith("/__init__.py")

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            name = self.module_file(module)
            tree = None
            if name is not None:
                try:
                    tree = ast.parse(self.text(name), filename=name)
                except SyntaxError:
                    tree = None
            self._trees[module] = tree
        return self._trees[module]

    def modules(self) -> Iterable[str]:
        for name in sorted(self.files):
            module = name[: -len(".py")].replace("/", ".")
            yield module[: -len(".__init__")] if module.endswith(".__init__") else module

    def _version(self) -> str:
        if "vllm/_version.py" in self.files:
            match = re.search(r"""__version__\s*=\s*version\s*=\s*['"]([^'"]+)['"]""", self.text("vllm/_version.py"))
            if match:
                return match.group(1)
        match = re.search(r"vllm(?:_cpu)?-(\d[^-]*)-", self.path.name)
        return match.group(1) if match else "unknown"


# ------------------------------------------------------------------------------------------------- resolution


@dataclass
class Found:
    """What a dotted name resolves to in the source."""

    kind: str  # "module", "class", "function", "value", "external"
    module: str  # the module that defines it (or, for "external", the dotted name outside vLLM)
    node: Any = None  # the ClassDef / FunctionDef / statement
    owner: Any = None  # for a class member, the ClassDef that holds it


def _statements(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """A body's statements, the branches of its ``if``/``try``/``with`` blocks included (definitions under
    ``TYPE_CHECKING``, try/except imports)."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            yield from _statements(stmt.body)
            yield from _statements(stmt.orelse)
        elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            yield from _statements(stmt.body)  # type: ignore[attr-defined]
            for handler in stmt.handlers:  # type: ignore[attr-defined]
                yield from _statements(handler.body)
            yield from _statements(stmt.orelse)  # type: ignore[attr-defined]
            yield from _statements(stmt.finalbody)  # type: ignore[attr-defined]
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            yield from _statements(stmt.body)
        else:
            yield stmt


def _targets(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.Assign):
        names = []
        for target in stmt.targets:
            elts = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
            names += [t.id for t in elts if isinstance(t, ast.Name)]
        return names
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) and isinstance(stmt.target, ast.Name):
        return [stmt.target.id]
    return []


def _is_overload(node: ast.AST) -> bool:
    return any(
        (isinstance(d, ast.Name) and d.id == "overload") or (isinstance(d, ast.Attribute) and d.attr == "overload")
        for d in getattr(node, "decorator_list", ())
    )


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    if isinstance(node, ast.Call):
        return _dotted(node.func)
    if isinstance(node, ast.Subscript):  # Generic[T], Protocol[T]
        return _dotted(node.value)
    return None


def _in_vllm(module: str) -> bool:
    return module == "vllm" or module.startswith("vllm.")


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module of ``from <level dots><name> import ...`` written in ``module``."""
    if level == 0:
        return name or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([name] if name else []))


class Resolver:
    def __init__(self, source: Source):
        self.source = source

    # -- modules
    def lookup(self, module: str, name: str, seen: frozenset = frozenset()) -> Found | None:
        """``name`` in ``module``'s namespace (its definitions, imports, re-exports, submodules, lazy names)."""
        key = (module, name)
        if key in seen:
            return None
        seen = seen | {key}
        tree = self.source.tree(module)
        if tree is None:
            return None
        definitions, imports, stars, lazy = [], [], [], False
        for stmt in _statements(tree.body):
            if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if stmt.name == name and not _is_overload(stmt):
                    definitions.append(stmt)
                if stmt.name == "__getattr__":
                    lazy = True
            elif name in _targets(stmt):
                definitions.append(stmt)
            elif isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if alias.name == "*":
                        stars.append(stmt)
                    elif (alias.asname or alias.name) == name:
                        imports.append((stmt, alias))
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    bound = alias.asname or alias.name.split(".")[0]
                    if bound == name:
                        imports.append((stmt, alias))
        if definitions:
            node = definitions[-1]
            for candidate in reversed(definitions):  # a real definition over a placeholder assignment
                if isinstance(candidate, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    node = candidate
                    break
            kind = {ast.ClassDef: "class", ast.FunctionDef: "function", ast.AsyncFunctionDef: "function"}
            found = Found(kind.get(type(node), "value"), module, node)
            if found.kind == "value":
                alias = self._alias(module, node, seen)
                if alias is not None:
                    return alias
            return found
        for stmt, alias in imports:
            found = self._follow_import(module, stmt, alias, seen)
            if found is not None:
                return found
        submodule = f"{module}.{name}"
        if self.source.module_file(submodule):
            return Found("module", submodule)
        for stmt in stars:
            target = _absolute(module, self.source.is_package(module), stmt.level, stmt.module)
            found = self.lookup(target, name, seen)
            if found is not None:
                return found
        if lazy:
            return self._lazy(module, tree, name, seen)
        return None

    def _alias(self, module: str, stmt: ast.stmt, seen: frozenset) -> Found | None:
        """``Name = other.Name`` (a re-bound class or function): what it points to."""
        value = getattr(stmt, "value", None)
        if isinstance(value, (ast.Name, ast.Attribute)):
            dotted = _dotted(value)
            if dotted:
                found = self.resolve_dotted(module, dotted, seen)
                if found is not None and found.kind in ("class", "function", "module"):
                    return found
        return None

    def _follow_import(self, module: str, stmt: ast.stmt, alias: ast.alias, seen: frozenset) -> Found | None:
        if isinstance(stmt, ast.Import):
            target = alias.name if alias.asname else alias.name.split(".")[0]
            return self._module_or_external(target)
        assert isinstance(stmt, ast.ImportFrom)
        target = _absolute(module, self.source.is_package(module), stmt.level, stmt.module)
        if not _in_vllm(target):
            return Found("external", f"{target}.{alias.name}")
        if self.source.module_file(f"{target}.{alias.name}"):
            return Found("module", f"{target}.{alias.name}")
        return self.lookup(target, alias.name, seen)

    def _module_or_external(self, dotted: str) -> Found | None:
        if not _in_vllm(dotted):
            return Found("external", dotted)
        return Found("module", dotted) if self.source.module_file(dotted) else None

    def _lazy(self, module: str, tree: ast.Module, name: str, seen: frozenset) -> Found | None:
        """A module with ``__getattr__``: ``name`` as a key of one of its dict literals (``vllm.envs``'
        ``environment_variables``, ``vllm``'s ``MODULE_ATTRS = {"LLM": ".entrypoints.llm:LLM"}``), followed when the
        value names ``module:attr``."""
        for node in ast.walk(tree):
            if not isinstance(node, ast.Dict):
                continue
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == name:
                    if isinstance(value, ast.Constant) and isinstance(value.value, str) and ":" in value.value:
                        where, _, attr = value.value.partition(":")
                        target = _absolute(
                            module,
                            self.source.is_package(module),
                            len(where) - len(where.lstrip(".")),
                            where.lstrip(".") or None,
                        )
                        found = self.lookup(target, attr, seen)
                        if found is not None:
                            return found
                    return Found("value", module, node)
        return None

    def resolve_dotted(self, module: str, dotted: str, seen: frozenset = frozenset()) -> Found | None:
        """A dotted expression (``a.b.C``) as written in ``module``."""
        head, *rest = dotted.split(".")
        found = self.lookup(module, head, seen)
        if found is None:
            return Found("external", dotted) if hasattr(builtins, head) else None
        for part in rest:
            found = self.member(found, part)
            if found is None:
                return None
        return found

    # -- members
    def bases(self, found: Found) -> list[Found]:
        """A class's bases, resolved ("external" for a base outside vLLM's source)."""
        out = []
        for base in found.node.bases:
            dotted = _dotted(base)
            if dotted is None:
                continue
            resolved = self.resolve_dotted(found.module, dotted)
            out.append(resolved if resolved is not None else Found("external", dotted))
        return out

    def mro(self, found: Found) -> list[Found]:
        """The class and its bases (depth first, each once), externals included."""
        out: list[Found] = []
        todo = [found]
        seen: set[int] = set()
        while todo:
            klass = todo.pop(0)
            if klass.kind == "class":
                if id(klass.node) in seen:
                    continue
                seen.add(id(klass.node))
                out.append(klass)
                todo.extend(self.bases(klass))
            elif klass.kind == "external":
                out.append(klass)
        return out

    def class_body_member(self, klass: Found, name: str) -> Found | None:
        hits = []
        for stmt in _statements(klass.node.body):
            if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                if not _is_overload(stmt):
                    hits.append(stmt)
            elif name in _targets(stmt):
                hits.append(stmt)
        if not hits:
            return None
        node = hits[-1]
        kind = {ast.ClassDef: "class", ast.FunctionDef: "function", ast.AsyncFunctionDef: "function"}.get(
            type(node), "value"
        )
        return Found(kind, klass.module, node, owner=klass.node)

    def member(self, found: Found, name: str) -> Found | None:
        if found.kind == "module":
            return self.lookup(found.module, name)
        if found.kind == "class":
            for klass in self.mro(found):
                if klass.kind == "external":
                    continue
                hit = self.class_body_member(klass, name)
                if hit is not None:
                    return hit
            return None
        if found.kind == "function":
            decorators = {_dotted(d) for d in found.node.decorator_list}
            if name in _CACHE_ATTRS and decorators & _CACHE_DECORATORS:
                return Found("value", found.module, found.node)
            return None
        if found.kind == "external":
            return Found("external", f"{found.module}.{name}")
        return None

    def resolve(self, target: str) -> tuple[Found | None, str]:
        """``module:qualname``: what it is, or None and the first part not found."""
        module, _, qualname = target.partition(":")
        if self.source.module_file(module) is None:
            return None, f"module {module}"
        found: Found | None = Found("module", module)
        walked = module
        for part in qualname.split(".") if qualname else ():
            assert found is not None
            found = self.member(found, part)
            walked = f"{walked}{':' if walked == module else '.'}{part}"
            if found is None:
                return None, walked
        return found, ""

    def names_in(self, found: Found) -> list[str]:
        """The names a module or class defines (for close-match hints)."""
        out: list[str] = []
        if found.kind == "module":
            tree = self.source.tree(found.module)
            for stmt in _statements(tree.body if tree else []):
                if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.append(stmt.name)
                out += _targets(stmt)
        elif found.kind == "class":
            for klass in self.mro(found):
                if klass.kind == "class":
                    for stmt in _statements(klass.node.body):
                        if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                            out.append(stmt.name)
                        out += _targets(stmt)
        return sorted(set(out))

    def definers(self, name: str) -> list[str]:
        """Every module whose top level defines ``name`` (a class, function or assignment; not an import)."""
        pattern = re.compile(rf"^(?:class|def|async def)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]", re.M)
        out = []
        for module in self.source.modules():
            file = self.source.module_file(module)
            if file is None or not pattern.search(self.source.text(file)):
                continue
            tree = self.source.tree(module)
            for stmt in _statements(tree.body if tree else []):
                named = stmt.name if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) else None
                if named == name or name in _targets(stmt):
                    out.append(module)
                    break
        return out

    def declares(self, found: Found, name: str) -> tuple[bool, list[str]]:
        """Whether instances of class ``found`` carry ``name`` (the runtime check's rule, from source), and the
        bases outside vLLM's source it could not look into."""
        externals = []
        for klass in self.mro(found):
            if klass.kind == "external":
                externals.append(klass.module)
                continue
            if self.class_body_member(klass, name) is not None:
                return True, externals
            segment = ast.get_source_segment(self.source.text(self.source.module_file(klass.module) or ""), klass.node)
            if segment and assigns_attribute(segment, name):
                return True, externals
        return False, externals


def parameters(found: Found) -> tuple[str, ...] | None:
    """The parameter names, in order, as ``inspect.signature`` lists them (a class: its ``__init__``'s, less
    ``self``); None if ``found`` is not callable source."""
    node = found.node
    if found.kind != "function" or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args]
    if args.vararg:
        names.append(args.vararg.arg)
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg:
        names.append(args.kwarg.arg)
    return tuple(names)


# ------------------------------------------------------------------------------------------------------ checks


@dataclass
class Result:
    target: str
    status: str  # "ok", "missing", "moved to <target>", "signature changed", "attribute missing"
    details: str = ""
    platform: str | None = None
    expected_params: list[str] | None = None
    params: list[str] | None = None
    attrs: list[str] = field(default_factory=list)
    where: str = ""  # file and line of the definition found


def _where(source: Source, found: Found) -> str:
    file = source.module_file(found.module) if found.kind != "external" else None
    line = getattr(found.node, "lineno", None)
    return f"{file}:{line}" if file and line else (file or found.module)


def check_contract(resolver: Resolver, contract: Any) -> Result:
    """One contract against the source (``contract``: a :class:`Contract` or anything with its fields)."""
    source = resolver.source
    expected = tuple(contract.params) if contract.params is not None else None
    result = Result(
        contract.target,
        "ok",
        platform=contract.platform,
        attrs=list(contract.attrs),
        expected_params=list(expected) if expected is not None else None,
    )
    found, missing_part = resolver.resolve(contract.target)
    target = contract.target
    if found is None:
        moved = _moved(resolver, contract.target)
        if moved is None:
            result.status = "missing"
            result.details = f"{missing_part} not found" + _hint(resolver, missing_part)
            return result
        target, found = moved
        result.status = f"moved to {target}"
    result.where = _where(source, found)
    problems = []
    if found.kind == "external":
        result.details = f"resolves outside vLLM ({found.module}): not checked"
        return result
    if expected is not None:
        got = parameters(found)
        if got is None and found.kind == "class":
            init = resolver.member(found, "__init__")
            got = parameters(init)[1:] if init is not None and parameters(init) else None
        if got is None:
            problems.append(f"is a {found.kind}, parameters not read")
        else:
            result.params = list(got)
            problem = parameters_problem(got, expected)
            if problem:
                problems.append(problem)
                if result.status == "ok":
                    result.status = "signature changed"
    if contract.attrs:
        if found.kind != "class":
            problems.append(f"is a {found.kind}, attributes not read")
        else:
            missing, externals = [], []
            for name in contract.attrs:
                ok, externals = resolver.declares(found, name)
                if not ok:
                    missing.append(name)
            if missing:
                problems.append(
                    f"declares no attribute {', '.join(missing)}"
                    + (f" (bases outside vLLM not read: {', '.join(sorted(set(externals)))})" if externals else "")
                )
                if result.status == "ok":
                    result.status = "attribute missing"
    result.details = "; ".join(problems)
    return result


def _moved(resolver: Resolver, target: str) -> tuple[str, Found] | None:
    """Another module that defines the target's first qualname part, where the whole qualname resolves."""
    module, _, qualname = target.partition(":")
    head = qualname.split(".")[0]
    if not head:
        return None
    for other in resolver.definers(head):
        if other == module:
            continue
        found, _ = resolver.resolve(f"{other}:{qualname}")
        if found is not None:
            return f"{other}:{qualname}", found
    return None


def _hint(resolver: Resolver, missing_part: str) -> str:
    """Close names beside the part the lookup stopped at (``module:Class.name``)."""
    if missing_part.startswith("module "):
        return ""
    module, _, qualname = missing_part.partition(":")
    parent, _, name = qualname.rpartition(".")
    found, _ = resolver.resolve(f"{module}:{parent}")
    if found is None:
        return ""
    close = difflib.get_close_matches(name, resolver.names_in(found), n=3, cutoff=0.6)
    return f" (close: {', '.join(close)})" if close else ""


@dataclass
class ImportResult:
    file: str
    line: int
    module: str
    name: str | None
    status: str
    details: str = ""


def package_imports(
    root: Path = ROOT, folders: Iterable[str] = PACKAGE_FOLDERS
) -> list[tuple[str, int, str, str | None]]:
    """Every ``vllm`` import in the package's files: (file, line, module, imported name or None)."""
    out = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(), filename=rel)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    out += [(rel, node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "vllm"]
                elif (
                    isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm"
                ):
                    out += [(rel, node.lineno, node.module or "", a.name) for a in node.names]
    return out


def check_import(resolver: Resolver, file: str, line: int, module: str, name: str | None) -> ImportResult:
    result = ImportResult(file, line, module, name, "ok")
    if resolver.source.module_file(module) is None:
        moved = None
        if name is not None:
            moved = _moved(resolver, f"{module}:{name}")
        result.status = f"moved to {moved[0]}" if moved else "missing"
        result.details = f"module {module} not found"
        return result
    if name is None or name == "*":
        return result
    found = resolver.lookup(module, name)
    if found is None:
        moved = _moved(resolver, f"{module}:{name}")
        result.status = f"moved to {moved[0]}" if moved else "missing"
        result.details = f"{module} has no {name}" + _hint(resolver, f"{module}:{name}")
    return result


def report(source_path: str | Path, contracts: Iterable[Any], imports: Iterable[tuple] = ()) -> dict:
    source = Source(source_path)
    resolver = Resolver(source)
    results = [check_contract(resolver, c) for c in contracts]
    import_results = [check_import(resolver, *row) for row in imports]
    broken = [r for r in results if r.status != "ok"]
    return {
        "vllm_version": source.version,
        "source": Path(source.path).name,
        "summary": {
            "contracts": len(results),
            "ok": len(results) - len(broken),
            "broken": len(broken),
            "by_status": _count(r.status.split(" ")[0] if r.status.startswith("moved") else r.status for r in results),
            "imports": len(import_results),
            "imports_ok": sum(r.status == "ok" for r in import_results),
        },
        "contracts": [asdict(r) for r in results],
        "imports": [asdict(r) for r in import_results],
    }


def _count(values: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for value in values:
        out[value] = out.get(value, 0) + 1
    return dict(sorted(out.items()))


def format_table(data: dict) -> str:
    rows = [("contract", "platform", "status", "details")]
    for r in data["contracts"]:
        rows.append((r["target"], r["platform"] or "any", r["status"], r["details"]))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    status_width = min(max(len(row[2]) for row in rows), 40)
    lines = [
        f"vLLM {data['vllm_version']} ({data['source']}): "
        f"{data['summary']['ok']} of {data['summary']['contracts']} contracts hold"
    ]
    for row in rows:
        lines.append(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{status_width}}  {row[3]}".rstrip())
    if data["imports"]:
        bad = [r for r in data["imports"] if r["status"] != "ok"]
        lines.append("")
        lines.append(
            f"vllm imports in the package: {data['summary']['imports_ok']} of {data['summary']['imports']} resolve"
        )
        for r in bad:
            what = f"from {r['module']} import {r['name']}" if r["name"] else f"import {r['module']}"
            lines.append(f"  {r['file']}:{r['line']}  {what}  {r['status']}  {r['details']}".rstrip())
    return "\n".join(lines)


def dump(data: dict) -> str:
    """The report as JSON, one contract or import a line (reviewable diffs)."""
    parts = [f" {json.dumps(key)}: {json.dumps(value)}" for key, value in data.items() if not isinstance(value, list)]
    for key in ("contracts", "imports"):
        rows = ",\n".join(f"  {json.dumps(row)}" for row in data[key])
        parts.append(f" {json.dumps(key)}: [\n{rows}\n ]" if rows else f" {json.dumps(key)}: []")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def main(
    argv: list[str] | None = None, contracts: Iterable[Any] | None = None, imports: Iterable[tuple] | None = None
) -> int:
    """The command; ``contracts`` / ``imports`` (default: the plugin's, :func:`package_imports`) for tests."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", required=True, help="a vLLM wheel, a folder holding one, or a source tree")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    if contracts is None:
        from rcstat_vllm.patches import all_contracts  # imports the installed vLLM (the patch modules do)

        contracts = all_contracts()
    data = report(args.wheel, contracts, package_imports() if imports is None else imports)
    print(format_table(data))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(dump(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
