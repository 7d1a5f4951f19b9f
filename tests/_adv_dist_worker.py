"""Worker for tests/test_advantages.py: batch statistics of the advantage estimators over 2 ranks.

Run as ``python tests/_adv_dist_worker.py OUT_DIR`` under torchrun's environment (launched by
``torchforge.distributed.launch``); each rank writes its shard's advantages to
``OUT_DIR/advantages_rank<r>.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

GROUPS, G, T, K = 6, 4, 5, 2


def global_inputs() -> dict[str, torch.Tensor]:
    """A fixed global batch: rewards [B] (offset by 1e3, one tied group, one NaN), [B, K]
    rewards, token rewards [B, T] and a mask [B, T] with uneven lengths."""
    g = torch.Generator().manual_seed(7)
    B = GROUPS * G
    rewards = 1e3 + torch.randint(0, 5, (B,), generator=g).float() / 4
    rewards[:G] = 1e3  # a tied group
    rewards[5] = float("nan")
    multi = torch.randint(0, 3, (B, K), generator=g).float()
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    tokens = torch.randn(B, T, generator=g)
    return {"rewards": rewards, "multi": multi, "tokens": tokens, "mask": mask}


def advantages(data: dict[str, torch.Tensor], sum_over_ranks=None) -> dict[str, torch.Tensor]:
    from torchforge.advantages import group_advantages
    from torchforge.returns import reinforce_pp_advantages

    return {
        "batch": group_advantages(data["rewards"], group_size=G, scale="batch", sum_over_ranks=sum_over_ranks),
        "gdpo": group_advantages(data["multi"], group_size=G, reward_weights=[1.0, 0.5],
                                 sum_over_ranks=sum_over_ranks),
        "reinforce_pp": reinforce_pp_advantages(data["tokens"], data["mask"], gamma=0.9,
                                                sum_over_ranks=sum_over_ranks),
        "reinforce_pp_baseline": reinforce_pp_advantages(data["rewards"], data["mask"], group_size=G,
                                                         sum_over_ranks=sum_over_ranks),
    }


def main() -> None:
    from torchforge.distributed import (
        init_distributed,
        rank,
        sum_over_ranks,
        teardown_distributed,
        world_size,
    )

    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    assert init_distributed()
    try:
        r, n = rank(), world_size()
        per = GROUPS // n * G  # whole groups on each rank
        shard = {k: v[r * per:(r + 1) * per] for k, v in global_inputs().items()}
        torch.save(advantages(shard, sum_over_ranks), out / f"advantages_rank{r}.pt")
    finally:
        teardown_distributed()


if __name__ == "__main__":
    main()
    from torchforge.distributed import end_process

    end_process(0)  # every result is written: skip the shutdown where gloo can abort
