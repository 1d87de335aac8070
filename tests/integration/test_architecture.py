"""The import graph of vpipe follows docs/architecture.md: rooms, one direction, no hidden imports.

A room is a first-level subpackage of ``vpipe`` (``planner/``) or a top-level module
(``graph.py``; the package's ``__init__.py`` is the room of the public facade); the laboratory's
rooms are named the same way under ``vpipe_lab/`` (``vpipe_lab/runtime/``). The table in
docs/architecture.md says which rooms each room may import; every import between rooms
must be allowed there, the table must allow no cycle, and it must not allow what nobody
imports (so it stays a description of the code). Imports inside functions hide
dependencies, so each one is listed below with its reason: keeping a process free of
torch (or of what it does not need), or an optional extra.

Inside the rooms, one job per module: no module is longer than ``MAX_LINES``, and no two
modules import each other in a circle at module level, an import under ``if
TYPE_CHECKING:`` included (it hides the circle from Python, not from a reader).

Another object's private names (one leading underscore: torch's, or another vpipe object's)
are touched only in ``vpipe/compat/``, one module per foreign library, each access behind a
named function there: a torch that renames one breaks one place, and vpipe's own objects
offer what others read of them as public API. The laboratory (``vpipe_lab``) is held to
the same rule: it calls the library's compat functions.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("vpipe", "vpipe_lab")  # the library, and the laboratory built on it
DOC = ROOT / "docs" / "architecture.md"
HEADER = ["room", "job", "torch", "may import"]
MAX_LINES = 420  # past this a module does more than one job: split it by job

# Libraries a module may import where it uses them, wherever it is: optional or absent on some machines.
# (An import under ``try: ... except ImportError`` is optional by construction and allowed too:
# torch builds without NCCL, private torch names a version may lack.)
OPTIONAL_EXTRAS = {
    "matplotlib": "the plot extra (pip install 'vpipe[plot]')",
    "pynvml": "NVML exists only on machines with an NVIDIA driver",
    "torch.utils.tensorboard": "metrics='tensorboard' needs the tensorboard package (the metrics extra)",
    "wandb": "metrics='wandb' needs the wandb package, which vpipe does not install",
}

# module -> (what it imports inside functions, why). Each entry must still be needed.
LAZY_IMPORTS: dict[str, tuple[frozenset[str], str]] = {
    "vpipe.compat.torch_internals": (frozenset({"torch.distributed._functional_collectives"}),
                                     "only a process holding DTensors asks (they imported it); the module "
                                     "serves torch-only code that never imports torch.distributed"),
    "vpipe": (frozenset({"vpipe._attach", "vpipe.config", "vpipe.plan", "vpipe.schedules.pipedream",
                         "vpipe.schedules.pipedream_2bw", "vpipe.schedules.wpipe",
                         "vpipe.checkpoint.block_keys", "importlib.metadata"}),
              "the public names (and the version, read from package metadata) load on first "
              "use: `import vpipe` (the CLI, the planner daemon) loads no torch"),
    "vpipe.planner": (frozenset({"vpipe.planner.srp", "vpipe.planner.proposals", "vpipe.planner.cuts",
                                 "vpipe.planner.cost_model", "vpipe.planner.sr"}),
                      "entry points load on first use: the daemon imports vpipe.planner.judge without numpy"),
    "vpipe.monitors": (frozenset({"vpipe.monitors.stage", "vpipe.monitors.keep_all"}),
                       "the daemon reads vpipe.monitors.records: the package must import without torch"),
    "vpipe_lab.cli": (frozenset({"vpipe_lab.runtime.launch", "vpipe_lab.runtime.checkpoints",
                                 "vpipe_lab.runtime.trainer", "vpipe_lab.nas"}),
                  "only train and nas load torch: vpipe plan, logs, plot, planner, keys start without it"),
    "vpipe.planner.cli": (frozenset({"vpipe.profiling.command", "vpipe.profiling.schedule_layout"}),
                          "only --model and a multi-stage schedule load torch: vpipe plan GRAPH.json plans a "
                          "single-stage schedule without it"),
    "vpipe_lab.command": (frozenset({"vpipe_lab.cli"}),
                          "the laboratory's commands need the lab extra (rich): without it the vpipe command "
                          "still runs the library's"),
    "vpipe_lab.runtime.config": (frozenset({"vpipe_lab.runtime.models"}),
                             "the CLI builds its options from RunConfig without loading torch"),
    "vpipe_lab.runtime.measure": (frozenset({"vpipe_lab.runtime.launch"}),
                              "vpipe demo and bench measure from a torch-free parent (the CLI "
                              "imports vpipe_lab.demo)"),
    "vpipe.timeline": (frozenset({"vpipe.compat.torch_internals"}),
                       "the timeline is torch-free: it reads torch's profiler flag "
                       "through compat only once a producer has loaded torch"),
    "vpipe_lab.runtime.launch": (frozenset({"vpipe.tensor_manager.copy_engine", "vpipe.tensor_manager.budget",
                                        "vpipe.tensor_manager.pool", "vpipe.stage.blocks"}),
                             "the spawning parent imports launch for spawn(): it must not "
                             "load torch's pipelining"),
}


# Private names (one leading underscore) that stay outside vpipe/compat/, and why.
PUBLIC_UNDERSCORED = {
    "os._exit": "Python's public API: end the process at once, without cleanup (faults.py's injected crash)",
    "argparse._SubParsersAction": "the type of add_subparsers()'s result, which argparse names no other way",
}
# namedtuple's own public API, underscored so that it never clashes with a field name
NAMEDTUPLE_API = frozenset({"_asdict", "_replace", "_fields", "_field_defaults", "_make"})


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # what it imports: a module, or a package's attribute resolved to its submodule
    line: int
    in_function: bool
    guarded: bool = False  # under ``try: ... except ImportError``


@cache
def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def room(module: str) -> str:
    """``planner/`` for vpipe.planner.*, ``graph.py`` for vpipe.graph, ``__init__.py`` for vpipe itself;
    the laboratory's the same behind ``vpipe_lab/`` (``vpipe_lab/runtime/``, ``vpipe_lab/cli.py``)."""
    package, *parts = module.split(".")
    prefix = "" if package == "vpipe" else f"{package}/"
    if not parts:
        return f"{prefix}__init__.py"
    return f"{prefix}{parts[0]}/" if (ROOT / package / parts[0]).is_dir() else f"{prefix}{parts[0]}.py"


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not modules()[module].name == "__init__.py":
        base = base[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: str, node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        source = _resolve(module, node)
        for alias in node.names:  # `from vpipe import log` imports the module vpipe.log
            sub = f"{source}.{alias.name}"
            yield sub if sub in modules() or sub in OPTIONAL_EXTRAS else source


def _lazy_exports(tree: ast.Module) -> Iterator[tuple[str, int]]:
    """Module names in an ``__init__``'s dict literals: exports loaded by ``importlib`` on first use."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for value in node.values:
                if isinstance(value, ast.Constant) and isinstance(value.value,
                                                                  str) and value.value in modules():
                    yield value.value, value.lineno


def _catches_import_error(node: ast.Try) -> bool:
    names = set()
    for handler in node.handlers:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        names |= {k.id for k in kinds if isinstance(k, ast.Name)}
    return bool(names & {"ImportError", "ModuleNotFoundError"})


@cache
def imports() -> tuple[Import, ...]:
    found: list[Import] = []
    for module, path in modules().items():
        tree = ast.parse(path.read_text(), str(path))

        def visit(node: ast.AST, in_function: bool, guarded: bool) -> None:
            for child in ast.iter_child_nodes(node):
                inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    found.extend(Import(module, t, child.lineno, inside, guarded)
                                 for t in _targets(module, child))
                if isinstance(child, ast.Try) and _catches_import_error(child):
                    for statement in child.body:
                        visit(ast.Module([statement], []), inside, True)
                    for rest in (*child.handlers, *child.orelse, *child.finalbody):
                        visit(rest, inside, guarded)
                    continue
                visit(child, inside, guarded)

        visit(tree, False, False)
        if path.name == "__init__.py":
            found.extend(Import(module, target, line, True) for target, line in _lazy_exports(tree))
    return tuple(found)


@dataclass(frozen=True)
class Row:
    allowed: tuple[str, ...]  # the rooms it may import, as listed
    torch_free: tuple[str, ...]  # modules that must import without torch: the whole room, or those named


@cache
def table() -> dict[str, Row]:
    """docs/architecture.md's direction table, in its order (callers first)."""
    rows: dict[str, Row] = {}
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if _cells(line) == HEADER)
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        name, _job, torch, allowed = _cells(line, lower=False)
        (room_name,) = re.findall(r"`([^`]+)`", name)
        assert room_name not in rows, f"docs/architecture.md lists {room_name} twice"
        assert torch == "no" or torch.startswith("yes"), (
            f"{room_name}: the torch column starts with yes or no"
        )
        free = [m for m in modules() if room(m) == room_name] if torch == "no" else [
            _module_of(room_name, file) for file in re.findall(r"`([^`]+)`", torch)]
        rows[room_name] = Row(tuple(re.findall(r"`([^`]+)`", allowed)), tuple(free))
    return rows


def _module_of(room_name: str, file: str) -> str:
    package = "vpipe_lab" if room_name.startswith("vpipe_lab/") else "vpipe"
    module = f"{package}.{room_name.removeprefix('vpipe_lab/').rstrip('/')}.{file.removesuffix('.py')}"
    assert module in modules(), f"docs/architecture.md names {file} in {room_name}, which has no such module"
    return module


def _cells(line: str, lower: bool = True) -> list[str]:
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    return [c.lower() for c in cells] if lower else cells


def _between_rooms() -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = {}
    for imp in imports():
        if imp.target.split(".")[0] in PACKAGES and room(imp.target) != room(imp.module):
            edges.setdefault((room(imp.module), room(imp.target)), []).append(f"{imp.module}:{imp.line}")
    return edges


def test_the_table_names_every_room_once():
    rooms = {room(m) for m in modules()}
    listed = set(table())
    assert rooms - listed == set(), f"rooms missing from docs/architecture.md: {sorted(rooms - listed)}"
    assert listed - rooms == set(), (
        f"docs/architecture.md lists rooms that do not exist: {sorted(listed - rooms)}"
    )
    for name, row in table().items():
        assert set(row.allowed) <= rooms, (
            f"{name} may import unknown rooms {sorted(set(row.allowed) - rooms)}"
        )


def test_the_library_never_imports_the_laboratory():
    """``pip install vpipe`` without the lab extra must still import
    and attach: no vpipe module reaches vpipe_lab."""
    reaching = [f"{imp.module}:{imp.line} imports {imp.target}" for imp in imports()
                if imp.module.split(".")[0] == "vpipe" and imp.target.split(".")[0] == "vpipe_lab"]
    assert not reaching, f"the library imports the laboratory: {reaching}"


def test_every_import_between_rooms_is_allowed_by_the_table():
    wrong = {f"{src} -> {dst}": where for (src, dst), where in _between_rooms().items()
             if dst not in table()[src].allowed}
    assert not wrong, f"imports docs/architecture.md does not allow: {wrong}"


def test_the_table_allows_only_what_is_imported():
    used = set(_between_rooms())
    unused = [f"{src} -> {dst}" for src, row in table().items() for dst in row.allowed
              if (src, dst) not in used]
    assert not unused, f"docs/architecture.md allows imports nobody makes (remove them): {unused}"


def test_the_rooms_import_each_other_one_way():
    """Each row may import only rows below it: the table is a topological order, so no cycle is allowed."""
    order = list(table())
    upward = {f"{src} -> {dst}" for src, row in table().items() for dst in row.allowed
              if order.index(dst) <= order.index(src)}
    assert not upward, f"rows allowed to import a row above them (a cycle): {sorted(upward)}"


def test_imports_inside_functions_are_the_listed_exceptions():
    unlisted = []
    used: dict[str, set[str]] = {}
    for imp in imports():
        if not imp.in_function or imp.guarded or any(imp.target == x or imp.target.startswith(x + ".")
                                                     for x in OPTIONAL_EXTRAS):
            continue
        targets, _why = LAZY_IMPORTS.get(imp.module, (frozenset(), ""))
        if imp.target in targets:
            used.setdefault(imp.module, set()).add(imp.target)
        else:
            unlisted.append(f"{imp.module}:{imp.line} imports {imp.target}")
    assert not unlisted, ("import at module level, or list the exception and its reason in LAZY_IMPORTS: "
                          f"{unlisted}")
    stale = {m: sorted(targets - used.get(m, set())) for m, (targets, _) in LAZY_IMPORTS.items()
             if targets - used.get(m, set())}
    assert not stale, f"LAZY_IMPORTS lists imports that are no longer made inside functions: {stale}"


def test_torch_free_rooms_import_without_torch():
    free = sorted(m for row in table().values() for m in row.torch_free if not m.endswith("__main__"))
    code = (f"import importlib, sys\nfor name in {free!r}:\n    importlib.import_module(name)\n"
            "    if 'torch' in sys.modules:\n        print(name)\n        break\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", (
        f"{proc.stdout.strip()} loads torch, yet docs/architecture.md says it does not"
    )


def test_no_module_is_longer_than_max_lines():
    long = {m: n for m, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split each by job): {long}"


def module_graph() -> dict[str, set[str]]:
    """Each module -> the vpipe modules it imports at module level (under ``if TYPE_CHECKING:`` too)."""
    graph: dict[str, set[str]] = {m: set() for m in modules()}
    for imp in imports():
        if not imp.in_function and imp.target in modules() and imp.target != imp.module:
            graph[imp.module].add(imp.target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports (its first module repeated at the end), or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(module: str) -> list[str] | None:
        path.append(module)
        on_path.add(module)
        for target in sorted(graph[module]):
            if target in on_path:
                return path[path.index(target):] + [target]
            if target not in done:
                found = visit(target)
                if found:
                    return found
        path.pop()
        on_path.discard(module)
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done:
            found = visit(module)
            if found:
                return found
    return None


def test_find_cycle_names_the_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]


def test_no_modules_import_each_other_in_a_circle():
    """A circle closed by an import under ``if TYPE_CHECKING:`` counts: give one side a narrow interface."""
    cycle = find_cycle(module_graph())
    assert cycle is None, (
        f"modules import each other in a circle (TYPE_CHECKING imports count): {' -> '.join(cycle)}"
    )


# ---------------------------------------------------------------------- private names of other objects
def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_package(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def _is_dict_of(node: ast.AST) -> bool:
    """``x.__dict__``: an object's attributes, read past its class."""
    return isinstance(node, ast.Attribute) and node.attr == "__dict__"


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def private_touches(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, what) for each private name of another object that ``tree`` touches: ``x._y`` (not
    on ``self`` or ``cls``), ``getattr(x, "_y")`` and its kin, ``x.__dict__["_y"]`` /
    ``.get("_y")`` / ``"_y" in x.__dict__``, and imports of a foreign private module or name
    (``from torch._C import ...``, ``from torch.x import _y``)."""
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _private(n.attr)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and id(node) not in inner:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) \
                    and node.attr not in NAMEDTUPLE_API:
                yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2:
            name = _literal(node.args[1])
            if name is not None and _private(name):
                yield node.lineno, f"{node.func.id}({ast.unparse(node.args[0])}, {name!r})"
        elif isinstance(node, ast.Call) and isinstance(node.func,
                                                       ast.Attribute) and _is_dict_of(node.func.value) \
                and node.args and (name := _literal(node.args[0])) is not None and _private(name):
            yield node.lineno, f"{ast.unparse(node.func)}({name!r})"
        elif isinstance(node, ast.Subscript) and _is_dict_of(node.value) \
                and (name := _literal(node.slice)) is not None and _private(name):
            yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.Compare) and (name := _literal(node.left)) is not None and _private(name) \
                and any(_is_dict_of(c) for c in node.comparators):
            yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if not _own_package(alias.name) and any(_private(part) for part in alias.name.split(".")):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            foreign = not _own_package(node.module)
            for alias in node.names:
                if (foreign and any(_private(part)
                                    for part in node.module.split("."))) or _private(alias.name):
                    yield node.lineno, f"from {node.module} import {alias.name}"


def test_private_touches_names_each_kind():
    code = ("import torch._C\nfrom torch.a._b import c\nfrom torch.a import _d\nfrom vpipe._attach import "
            "attach\nself._ok, cls._ok, os._exit, t._replace()\nm._modules\ntorch._C._x\ngetattr(m, '_y', "
            "None)\nm.__dict__.get('_z')\nm.__dict__['_w']\n'_v' in m.__dict__\nm.__dict__.get('forward')\n")
    found = [what for _, what in private_touches(ast.parse(code))]
    assert sorted(found) == sorted([
        "import torch._C", "from torch.a._b import c", "from torch.a import _d", "os._exit", "m._modules",
        "torch._C._x", "getattr(m, '_y')", "m.__dict__.get('_z')", "m.__dict__['_w']", "'_v' in m.__dict__"])


def test_only_the_compat_modules_touch_private_names_of_other_objects():
    """torch's private attributes (and vpipe objects' own) are reached through vpipe/compat/ alone, from the
    library and the laboratory alike: the laboratory calls the library's compat functions."""
    wrong, seen = [], set()
    for module, path in modules().items():
        if module.startswith("vpipe.compat"):
            continue
        file = str(path.relative_to(ROOT))
        for line, what in private_touches(ast.parse(path.read_text(), file)):
            if what in PUBLIC_UNDERSCORED:
                seen.add((file, what))
            else:
                wrong.append(f"{file}:{line} {what}")
    assert not wrong, ("private names of other objects outside vpipe/compat/: add a named function to "
                       f"vpipe/compat/ (or public API to the vpipe object) and call it: {wrong}")
    stale = sorted(w for w in PUBLIC_UNDERSCORED if not any(w == s for _, s in seen))
    assert not stale, f"allowed private names no longer used (remove them from the lists): {stale}"


# ---------------------------------------------------------------------- the environment
# reads every VPIPE_* variable, once, where vpipe starts (docs/architecture.md)
SETTINGS_MODULE = "vpipe.settings"
# Modules that still read a VPIPE_* variable themselves, each with its
# reason; each entry must still be needed.
ENVIRONMENT_READERS: dict[str, str] = {}
_LOG_CALLS = {"debug", "info", "warning", "error", "exception", "critical", "log"}
_ENVIRON_WRITES = {"pop", "popitem", "update", "setdefault", "clear", "__setitem__", "__delitem__"}


def _library_trees() -> Iterator[tuple[str, ast.Module]]:
    for module, path in modules().items():
        if module.split(".")[0] == "vpipe":
            yield module, ast.parse(path.read_text(), str(path))


def _variable_names() -> set[str]:
    """Names of module-level constants whose value is a VPIPE_* variable's name (``RUN_SECRET_ENV`` ...)."""
    names = set()
    for _module, tree in _library_trees():
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, str) and node.value.value.startswith("VPIPE_"):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _names_a_variable(node: ast.AST | None, constants: set[str]) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.startswith("VPIPE_")
    return (isinstance(node, ast.Name) and node.id in constants) or \
        (isinstance(node, ast.Attribute) and node.attr in constants)


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` (or ``environ`` imported from os)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
            and node.value.id == "os") or (isinstance(node, ast.Name) and node.id == "environ")


def _variable_reads(tree: ast.Module, constants: set[str]) -> Iterator[int]:
    """Lines that look a VPIPE_* variable up: ``X.get(NAME)``, ``X[NAME]``, ``NAME in X`` (any mapping: an
    environment is often passed on under another name), a call handed a variable's name (``getenv(NAME)``, a
    helper that reads it), and ``os.environ`` looked up by a computed name (it could be one)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and any(_names_a_variable(arg, constants)
                                              for arg in node.args) and not (
                isinstance(node.func, ast.Attribute) and node.func.attr in _LOG_CALLS):  # a name in a message
            yield node.lineno
        elif isinstance(node, ast.Call) and node.args and not isinstance(node.args[0], ast.Constant) and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                 and _is_environ(node.func.value))
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "getenv")):
            yield node.lineno
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and (
                _names_a_variable(node.slice, constants)
                or (_is_environ(node.value) and not isinstance(node.slice, ast.Constant))):
            yield node.lineno
        elif isinstance(node, ast.Compare) and _names_a_variable(node.left, constants) \
                and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            yield node.lineno


def test_only_the_settings_module_reads_vpipe_variables():
    """Every VPIPE_* variable is read in vpipe/settings.py, once, where vpipe starts; the parts get the value.
    (A launcher builds its children's environment: that is a dict it writes, not a read; the laboratory's
    own variables, VPIPE_HEARTBEAT_TIMEOUT and the warm starter's, are the laboratory's.)"""
    constants = _variable_names()
    readers = {module: lines for module, tree in _library_trees() if module != SETTINGS_MODULE
               if (lines := sorted(set(_variable_reads(tree, constants))))}
    unexpected = {m: lines for m, lines in readers.items() if m not in ENVIRONMENT_READERS}
    assert not unexpected, (
        f"VPIPE_* variables read outside {SETTINGS_MODULE} (take them from Settings): {unexpected}"
    )
    stale = sorted(set(ENVIRONMENT_READERS) - set(readers))
    assert not stale, f"ENVIRONMENT_READERS lists modules that no longer read a VPIPE_* variable: {stale}"
    tree = ast.parse((ROOT / "vpipe" / "settings.py").read_text())
    assert any(_is_environ(node)
               for node in ast.walk(tree)), "vpipe/settings.py no longer reads the environment"


def test_the_library_never_writes_the_environment():
    """Values pass between vpipe's parts as arguments, and to a child process in an environment built for it:
    ``os.environ`` is the user's."""
    writes = []
    for module, tree in _library_trees():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
                [node.target] if isinstance(node, ast.AugAssign) else []
            if any(isinstance(t, ast.Subscript) and _is_environ(t.value) for t in targets):
                writes.append(f"{module}:{node.lineno}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                    (node.func.attr in _ENVIRON_WRITES and _is_environ(node.func.value))
                    or (node.func.attr in ("putenv", "unsetenv") and isinstance(node.func.value, ast.Name)
                        and node.func.value.id == "os")):
                writes.append(f"{module}:{node.lineno}")
    assert not writes, f"the library writes os.environ (pass the value on instead): {writes}"


def test_the_environment_checks_see_what_they_look_for():
    constants = {"SECRET_ENV"}
    tree = ast.parse("import os\nos.environ.get('VPIPE_X')\nenv[SECRET_ENV]\nos.getenv(m.SECRET_ENV)\n"
                     "'VPIPE_Y' in environ\nos.environ.get('HOME')\n{'VPIPE_Z': 1}\nos.environ.get(name)\n"
                     "os.environ[name]\n_env_seconds('VPIPE_T', 5.0)\nos.environ.items()\n")
    assert sorted(_variable_reads(tree, constants)) == [2, 3, 4, 5, 8, 9, 10]
