"""The tensor manager's parts see narrow interfaces: each is built with what it reads, and nothing is set
on a part from outside after it was built (read from the source, as
tests/integration/test_architecture.py reads imports)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "vpipe" / "tensor_manager"
MOST_COLLABORATORS = 5


def _trees() -> dict[str, ast.Module]:
    return {path.name: ast.parse(path.read_text()) for path in sorted(PACKAGE.glob("*.py"))}


def _defined_classes(trees: dict[str, ast.Module]) -> set[str]:
    return {node.name for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any("dataclass" in ast.unparse(d) for d in node.decorator_list)


def _constructor_annotations(node: ast.ClassDef) -> list[tuple[str, str]]:
    """(parameter, annotation) of what a class is built with: its ``__init__``'s, or a dataclass's fields."""
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            params = [*item.args.posonlyargs, *item.args.args[1:], *item.args.kwonlyargs]
            return [(p.arg, ast.unparse(p.annotation)) for p in params if p.annotation is not None]
    if _is_dataclass(node):
        return [(item.target.id, ast.unparse(item.annotation)) for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)]
    return []


def collaborators(node: ast.ClassDef, classes: set[str]) -> list[str]:
    """The parameters that hand a class another tensor-manager object (a class or
    Protocol of the package), or a callback into one (a ``Callable``); plain
    settings, devices, locks and modules are not collaborators."""
    out = []
    for name, annotation in _constructor_annotations(node):
        names = set(re.findall(r"[A-Za-z_]\w*", annotation))
        if names & classes or "Callable" in names:
            out.append(name)
    return out


def test_every_part_is_built_with_at_most_five_collaborators():
    trees = _trees()
    classes = _defined_classes(trees)
    counted = {f"{module}:{node.name}": collaborators(node, classes)
               for module, tree in trees.items() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    # (the rule sees collaborators)
    assert {"budget", "phases"} <= set(counted["interception.py:Interceptor"])
    too_many = {part: names for part, names in counted.items() if len(names) > MOST_COLLABORATORS}
    assert not too_many, f"parts built with more than {MOST_COLLABORATORS} collaborators: {too_many}"


def _assigned(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    out: list[ast.expr] = []
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets.extend(target.elts)
        else:
            out.append(target)
    return out


def _own(target: ast.expr) -> bool:
    """``self.x`` or ``self.x[k]``: a field of the object itself (or an item of a container it owns)."""
    if isinstance(target, ast.Subscript):
        target = target.value
    return isinstance(target, ast.Attribute) and isinstance(target.value,
                                                            ast.Name) and target.value.id == "self"


def test_the_front_class_sets_only_its_own_fields():
    # a part's field set from manager.py (``calls.mb = ...``, ``part.back_reference = self``) is wiring after
    # construction or the facade doing a part's job: it calls the part's methods instead
    tree = ast.parse((PACKAGE / "manager.py").read_text())
    foreign = [f"line {target.lineno}: {ast.unparse(target)}" for node in ast.walk(tree)
               for target in _assigned(node)
               if isinstance(target, (ast.Attribute, ast.Subscript)) and not _own(target)]
    assert not foreign, foreign
