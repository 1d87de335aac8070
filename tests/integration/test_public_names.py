"""The package's public names: the one line works whatever the user imported first, and a type checker sees
each name with its real type (tests/typed_user_code.py, checked by mypy, shows it from the user's side)."""

from __future__ import annotations

import ast
import subprocess
import sys
import typing
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.distributed_c10d import Store
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

import vpipe
from vpipe import _attach

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("first", ["import vpipe", "from vpipe import VpipeConfig", "import vpipe._attach",
                                   "from vpipe._attach import VpipeConfig",
                                   "from vpipe.config import VpipeConfig",
                                   "from vpipe.rank.config import VpipeConfig"])
def test_vpipe_attach_is_the_one_line_after_any_import(first):
    code = (f"{first}\nimport vpipe\n"
            "try:\n    vpipe.attach(object())\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # attach's own first check, not "'module' object is not callable"
    assert out.stdout.strip() == ("RuntimeError vpipe.attach needs torch.distributed initialised first "
                                  "(torchrun or vpipe train)")


def test_a_type_checker_sees_every_public_name_where_it_is_loaded_from():
    """The ``if TYPE_CHECKING:`` imports name every lazy public
    name, from the module ``__getattr__`` loads."""
    tree = ast.parse((ROOT / "vpipe" / "__init__.py").read_text())
    guarded = next(node for node in tree.body if isinstance(node, ast.If)
                   and ast.unparse(node.test) == "TYPE_CHECKING")
    seen = {alias.name: node.module for node in guarded.body if isinstance(node, ast.ImportFrom)
            for alias in node.names}
    assert seen == vpipe._PUBLIC
    assert sorted(vpipe.__all__) == sorted([*vpipe._PUBLIC, "__version__"])
    assert all(getattr(vpipe, name) is not None for name in vpipe.__all__)


def test_attach_and_vpipe_have_typed_parameters():
    target = PipelineScheduleSingle | PipelineScheduleMulti | nn.Module
    assert typing.get_type_hints(vpipe.attach) == {
        "target": target, "optimizer": torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
        "config": vpipe.VpipeConfig | None,
        "store": Store | None, "options": typing.Any, "return": vpipe.Vpipe}
    for name, method in vars(_attach.Vpipe).items():
        function = method.fget if isinstance(method, property) else method
        if callable(function) and (not name.startswith("_") or name == "__init__"):
            hints = typing.get_type_hints(function)
            assert "return" in hints, f"Vpipe.{name} has no return type"
            unannotated = set(
                function.__code__.co_varnames[
                    1 : function.__code__.co_argcount + function.__code__.co_kwonlyargcount
                ]
            ) - set(hints)
            assert not unannotated, f"Vpipe.{name}: parameters {sorted(unannotated)} have no type"


def test_the_version_is_pyprojects():
    """One place: pyproject's version, read back through the package metadata (or pyproject itself)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    assert vpipe.__version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert "__version__ =" not in (ROOT / "vpipe" / "__init__.py").read_text()


def test_a_source_tree_that_is_not_installed_reads_its_version_from_pyproject(monkeypatch):
    import importlib.metadata

    tomllib = pytest.importorskip("tomllib")
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert vpipe._version() == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
