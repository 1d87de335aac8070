"""Reading a run's saved parameters and optimizer state, and comparing them with a reference run's."""

from __future__ import annotations

from pathlib import Path

import torch


def load_run_params(out_dir: Path, stages: int) -> dict[str, torch.Tensor]:
    """All stages' saved parameters merged into one state dict (names are 'layer_id.param')."""
    merged: dict[str, torch.Tensor] = {}
    for rank in range(stages):
        state = torch.load(out_dir / f"rank{rank}.pt", weights_only=True)
        merged.update(state["params"])
    return merged


def load_run_optimizer(out_dir: Path, stages: int) -> dict[str, dict[str, torch.Tensor]]:
    """All stages' optimizer state, keyed by parameter name."""
    merged: dict[str, dict[str, torch.Tensor]] = {}
    for rank in range(stages):
        merged.update(torch.load(out_dir / f"rank{rank}.pt", weights_only=True)["optimizer"])
    return merged


def assert_optimizer_equal(actual: dict[str, dict[str, torch.Tensor]],
                           expected: dict[str, dict[str, torch.Tensor]]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, want in expected.items():
        assert sorted(actual[name]) == sorted(want), name
        for key, value in want.items():
            assert torch.equal(actual[name][key], value), f"optimizer state {name}.{key} differs"


def assert_params_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                        rtol: float = 0.0) -> None:
    assert sorted(actual) == sorted(expected)
    for name, want in expected.items():
        got = actual[name]
        if rtol == 0.0:
            assert torch.equal(got, want), f"{name}: max abs diff {(got - want).abs().max().item():.3e}"
        else:
            rel = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
            assert rel <= rtol, f"{name}: max relative difference {rel:.3e} > {rtol:.0e}"


def assert_losses_close(ranks: list[dict], rel: float) -> None:
    """Each rank's losses with vpipe (``losses["vpipe"]``) within
    ``rel`` of the plain run's, and some losses."""
    for r in ranks:
        plain, moved = r["losses"]["plain"], r["losses"]["vpipe"]
        assert len(plain) == len(moved)
        for a, b in zip(plain, moved):
            assert abs(a - b) <= rel * abs(a), (r["rank"], a, b)
    assert any(r["losses"]["plain"] for r in ranks)
