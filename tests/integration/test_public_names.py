"""The package's public names work whatever the user imported first."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("first", ["import vpipe", "from vpipe.attach import VpipeConfig", "import vpipe.attach"])
def test_vpipe_attach_is_the_one_line_after_any_import(first):
    code = (f"{first}\nimport vpipe\n"
            "try:\n    vpipe.attach(object())\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # attach's own first check, not "'module' object is not callable"
    assert out.stdout.strip() == ("RuntimeError vpipe.attach needs torch.distributed initialised first "
                                  "(torchrun or vpipe train)")
