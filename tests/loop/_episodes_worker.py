"""The worker of the 2-process episode test (tests/loop/test_environments.py): each rank plays
its half of the rows with their global ids, and rank 0 saves every rank's episodes.

Run as ``python tests/loop/_episodes_worker.py OUT_FILE STRATEGY`` with torchrun's environment
(RANK, WORLD_SIZE, ...); :func:`launch` starts N of them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

WORKER = Path(__file__).resolve()
NUM_ROWS, G = 4, 2


class Countdown:
    """Row ``n`` plays ``n`` turns (so ranks finish after different numbers of turns); reward = len(action)."""

    def reset(self, row):
        self.left = row["turns"]
        return row["prompt"]

    def step(self, action):
        self.left -= 1
        return (f"{self.left}=", float(len(action)), self.left == 0)


def rows() -> list[dict]:
    return [{"prompt": f"{i}{i}=", "turns": 1 + 2 * (i // 2)} for i in range(NUM_ROWS)]  # 1, 1, 3, 3


def play(model, tokenizer, row_ids: list[int]) -> list[dict]:
    """The episodes of ``row_ids`` as plain per-episode records."""
    from torchforge.loop.environments import rollout_episodes

    batch, episodes = rollout_episodes(
        model, tokenizer, [Countdown() for _ in range(len(row_ids) * G)], rows=[rows()[i] for i in row_ids],
        num_generations=G, max_turns=4, max_new_tokens_per_turn=4, max_total_tokens=24, seed=11,
        episode_ids=row_ids,
    )
    out = []
    for b in range(batch.batch_size[0]):
        n = int(episodes.lengths[b])
        out.append({"tokens": batch.tokens[b, :n].tolist(), "mask": batch.mask[b, :n].tolist(),
                    "rollout_log_probs": batch.rollout_log_probs[b, :n], "rewards": batch.rewards[b, :n].tolist(),
                    "reason": episodes.reasons[b], "turns": int(episodes.turns[b])})
    return out


def launch(nproc: int, out_file: Path, strategy: str, timeout: float = 240) -> None:
    """Start ``nproc`` workers with torchrun's environment; raise with their output on failure."""
    from tests._dist_worker import spawn

    spawn(WORKER, [str(out_file), strategy], nproc, timeout)


def main() -> None:
    from torchforge.distributed import (
        init_distributed,
        rank,
        shard,
        teardown_distributed,
        world_size,
    )
    from torchforge.trainer.demo import char_tokenizer, tiny_llama

    torch.set_num_threads(1)
    out_file, strategy = Path(sys.argv[1]), sys.argv[2]
    assert init_distributed()
    try:
        tokenizer = char_tokenizer()
        model = shard(tiny_llama(tokenizer, seed=3), strategy=strategy)
        share = NUM_ROWS // world_size()
        mine = play(model, tokenizer, list(range(rank() * share, (rank() + 1) * share)))
        gathered = [None] * world_size()
        torch.distributed.all_gather_object(gathered, mine)
        if rank() == 0:
            torch.save([episode for part in gathered for episode in part], out_file)
    finally:
        teardown_distributed()


if __name__ == "__main__":
    main()
    from torchforge.distributed import end_process

    end_process(0)  # every result is written: skip the shutdown where gloo can abort
