"""The library apart from its laboratory: ``import vpipe`` and ``vpipe.attach`` need
only the library's dependencies; the ``vpipe`` command without the lab extra runs
the library's commands and names what the others need."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

from support.graphs import chain
from support.processes import ROOT, child_env

# The extras and the laboratory, made unimportable in a child interpreter: what a `pip install vpipe` lacks.
ABSENT = ("rich", "matplotlib", "vpipe_lab", "transformers", "tensorboard", "networkx", "hypothesis",
          "pytest")

# A name set to None in sys.modules cannot be imported, and importlib.util.find_spec reports it absent.
BLOCKER = f"import sys\nsys.modules.update(dict.fromkeys({ABSENT!r}))\n"


def _run_without_extras(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + textwrap.dedent(code)], cwd=tmp_path,
                          env=child_env(),
                          capture_output=True, text=True, timeout=120)


def test_the_library_imports_and_attaches_without_the_laboratory_or_any_extra(tmp_path):
    proc = _run_without_extras("""
        import inspect, vpipe
        assert inspect.isfunction(vpipe.attach), vpipe.attach
        for name in vpipe.__all__:
            getattr(vpipe, name)
        import vpipe.control.daemon, vpipe.planner.online, vpipe.config, vpipe.rank.config
        print("ok", vpipe.__version__)
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok ")


def test_the_vpipe_command_without_the_lab_extra_plans_and_names_what_demo_needs(tmp_path):
    graph = tmp_path / "g.json"
    chain([1.0] * 6, act=1_000_000, param=1_000_000).save(graph)
    proc = _run_without_extras(f"""
        # the laboratory is installed with the library: only its extra is missing
        del sys.modules["vpipe_lab"]
        from vpipe_lab.command import main
        assert main(["plan", {str(graph)!r}, "--stages", "2"]) == 0
        assert main(["demo"]) == 2
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "2 stages" in proc.stdout
    assert (
        proc.stderr.strip()
        == "vpipe demo is a vpipe laboratory command and needs rich: pip install 'vpipe[lab]'"
    )


def test_the_commands_named_as_the_labs_are_exactly_those_the_lab_adds():
    """The console script decides by name which commands need the
    lab extra: the names must follow the parsers."""
    from vpipe import cli as library_cli
    from vpipe_lab.cli import build_parser
    from vpipe_lab.command import LAB_COMMANDS

    def commands(parser) -> set[str]:
        return set(next(a for a in parser._actions if a.dest == "command").choices)

    assert commands(build_parser()) - commands(library_cli.build_parser()[0]) == set(LAB_COMMANDS)


@pytest.mark.slow
def test_pip_install_into_a_fresh_venv_brings_only_the_library_dependencies(tmp_path):
    """The real thing: a new venv, `pip install .`, then import and attach with no extra installed.

    When the base interpreter has neither rich nor matplotlib, the venv may see its packages
    (torch is a library dependency; installing it again only costs minutes); otherwise it sees none.
    """
    env_dir = tmp_path / "venv"
    base = subprocess.run([sys._base_executable, "-c", "import importlib.util as u; "
                           "print(any(u.find_spec(m) for m in ('rich', 'matplotlib')))"],
                          capture_output=True, text=True, timeout=60)
    venv.create(env_dir, with_pip=True, system_site_packages=base.stdout.strip() == "False")
    python = env_dir / "bin" / "python"
    # the installed vpipe, not this checkout
    clean = {k: v for k, v in child_env().items() if k != "PYTHONPATH"}
    install = subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(ROOT)], env=clean,
                             capture_output=True, text=True, timeout=1200)
    assert install.returncode == 0, install.stderr[-4000:]
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True,
                            text=True,
                            timeout=120).stdout.lower()
    assert "rich==" not in listed and "matplotlib==" not in listed, listed
    check = subprocess.run([str(python), "-c",
                            "import inspect, vpipe; assert inspect.isfunction(vpipe.attach); "
                            "vpipe.VpipeConfig(); print(vpipe.__file__)"], cwd=tmp_path, env=clean,
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr
    assert Path(check.stdout.strip()).is_relative_to(env_dir), check.stdout
    demo = subprocess.run([str(env_dir / "bin" / "vpipe"), "demo"], cwd=tmp_path, env=clean,
                          capture_output=True, text=True, timeout=120)
    assert demo.returncode == 2
    assert "pip install 'vpipe[lab]'" in demo.stderr
