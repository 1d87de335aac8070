"""The vpipe package of another revision, loaded next to this one: a change timed against the code before it.

The machines these benchmarks run on drift in speed between launches (a shared CPU, a GPU
lent for minutes), so a ratio between two launches says little. Loaded side by side, the
two versions alternate within one process, against the same plain step.

``load_vpipe(source)`` takes a git revision of this repository (exported with ``git
archive``) or a directory holding a ``vpipe`` package (a machine without the repository's
history: export it beforehand and carry the directory). The package is copied under the
name ``vpipe_at_<label>`` and its absolute imports (and module paths named in strings) are
rewritten to that name, so both versions import their own modules.

    python benchmarks/revision.py 6432128 --export .scratch/base   # then: --against .scratch/base
"""

from __future__ import annotations

import argparse
import importlib
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

__all__ = ["load_vpipe", "export_vpipe"]

REPO = Path(__file__).resolve().parent.parent
# "from vpipe.x import y", "from vpipe import y", "import vpipe.x": the package's own absolute imports; and
# module paths in strings ("vpipe.planner.srp", imported lazily; logger names follow, which is harmless)
_IMPORT = re.compile(r"^(\s*)(from|import) vpipe\b", re.MULTILINE)
_MODULE_PATH = re.compile(r"([\"'])vpipe\.")


def export_vpipe(revision: str, directory: Path) -> Path:
    """Write the ``vpipe`` package of a git revision under
    ``directory`` (for a machine without the history)."""
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "vpipe").exists():
        raise SystemExit(f"{directory / 'vpipe'} exists already; export into an empty directory")
    with tarfile.open(fileobj=io.BytesIO(_git(["archive", revision, "vpipe"]))) as archive:
        archive.extractall(directory, filter="data")
    return directory / "vpipe"


def load_vpipe(source: str) -> tuple[ModuleType, str]:
    """The ``vpipe`` package of ``source`` (a git revision or a
    directory that holds ``vpipe/``) and its label."""
    root = Path(tempfile.mkdtemp(prefix="vpipe-revision-"))
    given = Path(source)
    if (given / "vpipe" / "__init__.py").is_file():
        label = re.sub(r"\W", "_", given.resolve().name)
        shutil.copytree(given / "vpipe", root / "vpipe")
    else:
        label = _git(["rev-parse", "--short", source]).decode().strip()
        export_vpipe(label, root)
    name = f"vpipe_at_{label}"
    (root / "vpipe").rename(root / name)
    for path in (root / name).rglob("*.py"):
        text = _IMPORT.sub(rf"\1\2 {name}", path.read_text())
        path.write_text(_MODULE_PATH.sub(rf"\1{name}.", text))
    sys.path.insert(0, str(root))
    return importlib.import_module(name), label


def _git(args: list[str]) -> bytes:
    try:
        return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.decode().strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
        raise SystemExit(f"git {' '.join(args)}: {detail}; give a git revision of {REPO} "
                         "or a directory holding a vpipe package") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="a git revision, or a directory holding a vpipe package")
    p.add_argument("--export", type=Path, default=None, metavar="DIR",
                   help="write the revision's vpipe package under DIR instead of loading it")
    args = p.parse_args(argv)
    if args.export is not None:
        print(export_vpipe(args.source, args.export))
        return 0
    package, label = load_vpipe(args.source)
    print(f"{args.source} ({label}) loads as {package.__name__} from {Path(package.__file__ or '').parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
