"""Shared pytest set-up: tests marked ``cuda`` skip on machines without a GPU.

``make test-cuda`` asks :func:`cuda_problem` first and fails with its one-line reason,
instead of a run that skips every GPU test and passes.
"""

from __future__ import annotations

import pytest
import torch


def cuda_problem() -> str | None:
    """Why this machine cannot run bcg's GPU tests (``None``: it can)."""
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"torch.cuda.is_available() is False (torch {torch.__version__}, {build})"
    try:
        import cuda.bindings.runtime  # noqa: F401
    except ImportError as exc:
        return f"cuda-bindings is not importable ({exc}); graph capture needs it"
    try:
        (torch.ones(8, device="cuda") * 2).sum().item()
    except RuntimeError as exc:
        return f"a CUDA kernel failed to run: {str(exc).splitlines()[0]}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA not available)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def every_tier_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Staged tiers timed at capture (:mod:`bcg.runner.tiers`) all time faster than the form after
    them, so every tier is kept: for tests of what tiers do, not of which a timing keeps."""
    import bcg.runner.tiers

    monkeypatch.setattr(bcg.runner.tiers, "time_forms", lambda graph, indices, live, rounds=0: [[0.0], [1.0]])
