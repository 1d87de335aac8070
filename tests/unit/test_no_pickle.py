"""No pickle anywhere in vpipe: nothing it reads can run code.

Two passes over every ``.py`` file of the package: a line grep for the modules and calls
that unpickle (so a use hidden in a string or an ``exec`` is caught too), and an AST pass
for ``torch.load`` calls, whose safety depends on a keyword (``weights_only=True``) that
may sit on another line. Comments are ignored; docstrings saying "never pickle" are fine.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from support.processes import ROOT

PACKAGE = ROOT / "vpipe"

_LINE_PATTERNS = [
    (re.compile(r"^\s*import\s+(?:[\w.]+\s*,\s*)*_?c?pickle\b"), "import pickle"),
    (re.compile(r"^\s*from\s+_?c?pickle\b"), "from pickle"),
    (re.compile(r"\bcloudpickle\b"), "cloudpickle"),
    (re.compile(r"^\s*(?:import|from)\s+(?:dill|jsonpickle|shelve)\b|\b(?:dill|jsonpickle|shelve)\.\w"),
     "dill/jsonpickle/shelve"),
    (re.compile(r"\bpickle\s*\.\s*(?:load|loads|Unpickler)\b"), "pickle.load(s)"),
    (re.compile(r"\bmarshal\s*\.\s*loads?\b|^\s*(?:import|from)\s+marshal\b"), "marshal"),
    (re.compile(r"\ballow_pickle\s*=\s*True\b"), "allow_pickle=True"),
    (re.compile(r"""(?:import_module|__import__)\(\s*["'](?:_?c?pickle|cloudpickle|dill|marshal)["']"""),
     "pickle imported by name"),
]


def _code_part(line: str) -> str:
    """The line without a trailing ``#`` comment (good enough: vpipe
    has no '#' inside strings it greps for)."""
    return line.split("#", 1)[0]


def _torch_load_findings(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
        if name != "load" or owner not in ("torch", ""):
            continue
        if owner == "" and not _imported_from_torch(tree, "load"):
            continue
        safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                   for k in node.keywords)
        if not safe:
            found.append((node.lineno, "torch.load without weights_only=True"))
    return found


def _imported_from_torch(tree: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.ImportFrom) and n.module == "torch" and any(a.name == name for a in n.names)
               for n in ast.walk(tree))


def pickle_findings(root: Path) -> list[str]:
    """``path:line: what`` for every pickle-like use under ``root``."""
    findings = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        rel = path.relative_to(root.parent)
        for number, line in enumerate(source.splitlines(), 1):
            code = _code_part(line)
            for pattern, what in _LINE_PATTERNS:
                if pattern.search(code):
                    findings.append(f"{rel}:{number}: {what}: {line.strip()}")
        for number, what in _torch_load_findings(ast.parse(source, filename=str(path))):
            findings.append(f"{rel}:{number}: {what}")
    return findings


def test_vpipe_uses_no_pickle():
    assert PACKAGE.is_dir() and len(list(PACKAGE.rglob("*.py"))) > 20  # the scan really reads the package
    findings = pickle_findings(PACKAGE)
    assert findings == [], "pickle in vpipe (use msgpack, or torch.load(..., weights_only=True)):\n" + \
        "\n".join(findings)


BAD = {
    "import pickle": "import pickle\n",
    "import os, pickle": "import os, pickle\n",
    "from pickle import loads": "from pickle import loads\n",
    "import _pickle": "import _pickle as p\n",
    "cloudpickle": "import cloudpickle\n",
    "dill": "import dill\n",
    "pickle.loads": "x = pickle.loads(data)\n",
    "pickle.load": "x = pickle .load(f)\n",
    "marshal.loads": "code = marshal.loads(blob)\n",
    "numpy allow_pickle": "a = np.load(path, allow_pickle=True)\n",
    "torch.load bare": "state = torch.load(path)\n",
    "torch.load weights_only=False": "state = torch.load(path, weights_only=False)\n",
    "torch.load across lines": "state = torch.load(\n    path,\n    map_location='cpu',\n)\n",
    "from torch import load": "from torch import load; state = load(path)\n",
    "import_module": "m = importlib.import_module('pickle')\n",
}

GOOD = (
    '"""Never pickle: msgpack only."""\n'
    "# import pickle would be wrong here\nstate = torch.load(path, weights_only=True)\n"
    "state = torch.load(\n    path,\n    weights_only=True,\n)\ndata = msgpack.unpackb(raw)\n"
    "picklers = 0  # a name that merely contains the word\n"
)


@pytest.mark.parametrize("case", sorted(BAD))
def test_the_checker_finds_each_kind_of_use_and_names_file_and_line(tmp_path, case):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "fine.py").write_text(GOOD)
    (package / "bad.py").write_text("'''a module'''\n" + BAD[case])
    findings = pickle_findings(package)
    assert len(findings) == 1 and findings[0].startswith("pkg/bad.py:2: "), findings
