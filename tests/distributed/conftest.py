"""The 2-process results shared by the distributed tests: one torchrun launch of
tests/_dist_worker.py (gloo) running every scenario, once per session."""

from __future__ import annotations

import pytest
import torch

from tests import _dist_worker as W
from torchforge.distributed import launch


@pytest.fixture(scope="session")
def two_process_results(tmp_path_factory):
    """One torchrun launch (torchforge.distributed.launch) of 2 workers running all scenarios."""
    out = tmp_path_factory.mktemp("dist")
    rc = launch(2, [str(W.WORKER), str(out), "counts", "statistics", "grads", "generate"], module=None)
    assert rc == 0, "distributed workers failed (their output is above)"
    results = {name: torch.load(out / f"{name}.pt", weights_only=False) for name in ("grads", "generate")}
    results["counts"] = [torch.load(out / f"counts_rank{r}.pt", weights_only=False) for r in range(2)]
    results["statistics"] = [torch.load(out / f"statistics_rank{r}.pt", weights_only=True) for r in range(2)]
    return results
