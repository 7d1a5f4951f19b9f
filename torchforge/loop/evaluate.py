"""Evaluation: sampled and greedy completions of held-out prompts, their rewards and pass@k.

For each of N prompts, :func:`evaluate` samples ``n = num_generations`` completions (and,
with ``greedy=True``, one greedy completion), scores them with the reward functions
(:func:`torchforge.loop.score_rewards`), counts a completion as correct when its combined
reward is ``>= correct_threshold``, and reports:

- ``eval/reward``: the mean reward of the sampled completions;
- ``eval/pass@1`` and ``eval/pass@{k}``: the mean over prompts of the unbiased estimator
  :func:`pass_at_k` (Chen et al. 2021) with ``c`` correct of ``n`` samples;
- ``eval/greedy_reward`` and ``eval/greedy_accuracy``: the same for the greedy completion;
- ``eval/mean_length`` and ``eval/clipped_ratio`` of the sampled completions.

Under ``torchrun`` each process evaluates its share of the prompts and every figure is a
sum over processes divided by a count summed over processes
(:func:`torchforge.distributed.reduce_metric_sums`), so 2 processes report what 1 does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from torchforge.distributed import rank as process_rank
from torchforge.distributed import reduce_metric_sums, world_size
from torchforge.errors import InvalidArgumentError
from torchforge.loop.rewards import score_rewards
from torchforge.loop.engines import GenerationEngine
from torchforge.loop.rollout import decode_completions, rollout

__all__ = ["evaluate", "pass_at_k"]


def pass_at_k(n: int | torch.Tensor, c: int | torch.Tensor, k: int) -> torch.Tensor:
    """The unbiased estimate of pass@k from ``c`` correct among ``n`` samples (Chen et al. 2021).

    ``pass@k = 1 - C(n - c, k) / C(n, k)``, computed as the product
    ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (1 when ``n - c < k``), which never forms
    the large binomial coefficients.

    Args:
        n: samples per problem, an int or an int tensor of any shape S.
        c: correct samples per problem, ``0 <= c <= n``, an int or an int tensor of shape S.
        k: the budget, ``1 <= k <= n``.

    Returns:
        float64 tensor of shape S (a 0-d tensor for ints): the probability that at least
        one of k samples drawn without replacement from the n is correct.

    Example:
        >>> pass_at_k(10, torch.tensor([0, 1, 10]), 1)
        tensor([0.0000, 0.1000, 1.0000], dtype=torch.float64)
        >>> round(float(pass_at_k(4, 2, 2)), 6)  # 1 - C(2, 2) / C(4, 2) = 1 - 1/6
        0.833333

    References:
        Chen et al., "Evaluating Large Language Models Trained on Code", section 2.1,
        https://arxiv.org/abs/2107.03374

    Note:
        Computed in float64, not float32: the product runs over up to n factors and
        the result is a metric, not a training quantity.
    """
    fn = "pass_at_k"
    n_t, c_t = torch.as_tensor(n), torch.as_tensor(c)
    for name, value in (("n", n_t), ("c", c_t)):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise InvalidArgumentError(f"{fn}: {name} has dtype {value.dtype}; expected integers")
    n_t, c_t = torch.broadcast_tensors(n_t, c_t)
    if not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
        raise InvalidArgumentError(f"{fn}: k must be an int >= 1, got {k!r}")
    if bool((c_t < 0).any()) or bool((c_t > n_t).any()):
        raise InvalidArgumentError(f"{fn}: c must be in [0, n]; got c={c_t.tolist()} with n={n_t.tolist()}")
    if bool((n_t < k).any()):
        raise InvalidArgumentError(f"{fn}: k={k} is more than the samples n={n_t.tolist()}; expected k <= n")
    n_max = int(n_t.max()) if n_t.numel() else 0
    i = torch.arange(1, n_max + 1, dtype=torch.float64)              # the factor index, 1..n_max
    # factor i is used for i in (n - c, n]; the others are 1
    used = (i > (n_t - c_t)[..., None]) & (i <= n_t[..., None])
    factors = torch.where(used, 1.0 - k / i, 1.0)
    return torch.where(n_t - c_t < k, 1.0, 1.0 - factors.prod(-1)).to(torch.float64)


def _counts(rewards: torch.Tensor, *, num_prompts: int, n: int, threshold: float) -> torch.Tensor:
    """[N] number of correct completions per prompt (a NaN reward is not correct)."""
    correct = (rewards.nan_to_num(nan=-math.inf) >= threshold).reshape(num_prompts, n)
    return correct.sum(-1)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    reward_functions: Sequence[Callable],
    *,
    num_generations: int,
    k: int | None = None,
    max_new_tokens: int,
    columns: dict[str, Sequence[Any]] | None = None,
    weights: Sequence[float] | None = None,
    correct_threshold: float = 1.0,
    greedy: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    seed: int = 0,
    batch_size: int | None = None,
    shard: bool = True,
    engine: GenerationEngine | None = None,
    images: Sequence[Sequence[Any]] | None = None,
    processor: Any = None,
) -> dict[str, float]:
    """Sample and score completions of ``prompts``; mean reward, pass@1 and pass@k.

    With ``n = num_generations`` samples of prompt ``i``, ``c_i`` of them correct
    (combined reward ``>= correct_threshold``):
    ``eval/reward = mean_{i,g} r_ig`` (over non-NaN rewards),
    ``eval/pass@1 = mean_i pass_at_k(n, c_i, 1) = mean_i c_i / n``,
    ``eval/pass@{k} = mean_i pass_at_k(n, c_i, k)``; ``eval/greedy_reward`` and
    ``eval/greedy_accuracy`` score one greedy (``top_k=1``) completion per prompt.

    Args:
        model: a Hugging Face causal LM (plain, DDP or FSDP2: under ``torchrun`` every
            process calls this with the same arguments).
        tokenizer: its tokenizer.
        prompts: the N rendered prompts (all of them: with ``shard=True`` each process
            takes every ``world_size``-th one).
        reward_functions: RewardFunction objects and / or TRL-style callables.
        num_generations: n >= 1 sampled completions per prompt.
        k: the pass@k budget, in [1, n]; default n.
        max_new_tokens: the length limit of a completion.
        columns: other dataset fields, each a list of N values (one per prompt), passed to
            the reward functions (repeated for each completion).
        weights: one weight per reward function (default their ``weight``).
        correct_threshold: a completion is correct when its combined reward is >= this
            (1.0: an accuracy reward of 1; NaN rewards are never correct).
        greedy: also score one greedy completion per prompt.
        temperature: sampling temperature (> 0).
        top_p: nucleus filter of the sampled completions.
        top_k: top-k filter of the sampled completions (0: none).
        stop_token_ids: ids that end a completion (default the tokenizer's eos).
        seed: the sampling seed; prompt ``i`` gets the same samples on any number of processes.
        batch_size: prompts per ``generate`` call (default: all of this process's at once).
        shard: split the prompts over processes (False: this process's prompts are given).
        engine: the generation engine (:mod:`torchforge.loop.engines`); default Hugging Face
            ``generate`` on ``model``.
        images: N lists of PIL images, one per prompt ([] for a prompt without), for a
            vision-language model: sampled from as :func:`torchforge.loop.rollout` does (the
            reward functions get them when ``columns`` holds them, e.g. ``columns["images"]``).
        processor: the model's processor, with ``images``.

    Returns:
        name -> float, the same on every process: ``eval/reward``, ``eval/pass@1``,
        ``eval/pass@{k}``, ``eval/greedy_reward`` and ``eval/greedy_accuracy`` (with
        ``greedy``), ``eval/mean_length``, ``eval/clipped_ratio``, ``eval/num_prompts``.

    Example:
        >>> from torchforge.loop.tiny_model import char_tokenizer, tiny_llama
        >>> def copies(prompts, completions, **columns):  # 1 for a completion that repeats the digits
        ...     return [float(c == p.rstrip("=")) for p, c in zip(prompts, completions)]
        >>> tokenizer = char_tokenizer()
        >>> out = evaluate(tiny_llama(tokenizer), tokenizer, ["12=", "7="], [copies],
        ...                num_generations=4, k=2, max_new_tokens=3)
        >>> sorted(out)[:4], out["eval/num_prompts"]
        (['eval/clipped_ratio', 'eval/greedy_accuracy', 'eval/greedy_reward', 'eval/mean_length'], 2.0)

    References:
        pass@k: Chen et al. 2021, https://arxiv.org/abs/2107.03374
    """
    fn = "evaluate"
    if not prompts:
        raise InvalidArgumentError(f"{fn}: prompts is empty; expected at least one prompt")
    if not (isinstance(num_generations, int) and num_generations >= 1):
        raise InvalidArgumentError(f"{fn}: num_generations must be an int >= 1, got {num_generations!r}")
    n = num_generations
    k = n if k is None else k
    if not (isinstance(k, int) and 1 <= k <= n):
        raise InvalidArgumentError(f"{fn}: k must be an int in [1, num_generations={n}], got {k!r}")
    if batch_size is not None and not (isinstance(batch_size, int) and batch_size >= 1):
        raise InvalidArgumentError(f"{fn}: batch_size must be an int >= 1 or None, got {batch_size!r}")
    columns = dict(columns or {})
    for key, values in columns.items():
        if len(values) != len(prompts):
            raise InvalidArgumentError(f"{fn}: columns[{key!r}] has {len(values)} values for {len(prompts)} prompts; "
                                       "expected one per prompt")
    if images is not None and len(images) != len(prompts):
        raise InvalidArgumentError(f"{fn}: {len(images)} image lists for {len(prompts)} prompts; expected one per prompt")

    # this process's share, padded to the same length on every process so that every
    # process runs the same generate calls (FSDP forwards are collectives); padding rows count for nothing
    N = len(prompts)
    ids = list(range(process_rank(), N, world_size())) if shard else list(range(N))
    share = math.ceil(N / world_size()) if shard else N
    real = [True] * len(ids) + [False] * (share - len(ids))
    ids = ids + [ids[0] if ids else 0] * (share - len(ids))
    size = batch_size or max(share, 1)

    sums: dict[str, torch.Tensor] = {name: torch.zeros((), dtype=torch.float64) for name in (
        "reward_sum", "reward_n", "pass1", f"pass{k}", "prompts", "length", "truncated",
        "greedy_reward_sum", "greedy_reward_n", "greedy_correct")}
    for start in range(0, share, size):
        chunk, keep = ids[start:start + size], torch.tensor(real[start:start + size])
        chunk_prompts = [prompts[i] for i in chunk]
        chunk_columns = {key: [values[i] for i in chunk] for key, values in columns.items()}
        chunk_images = [images[i] for i in chunk] if images is not None else None
        modes = [("sampled", n, {"temperature": temperature, "top_p": top_p, "top_k": top_k})]
        if greedy:  # top_k=1 keeps only the most likely token: a greedy decode through the same sampler
            modes.append(("greedy", 1, {"temperature": 1.0, "top_p": 1.0, "top_k": 1}))
        for mode, G, sampling in modes:
            batch = rollout(model, tokenizer, chunk_prompts, num_generations=G, max_new_tokens=max_new_tokens,
                            stop_token_ids=stop_token_ids, seed=seed, prompt_ids=chunk, engine=engine,
                            images=chunk_images, processor=processor, **sampling)
            completions, completion_ids = decode_completions(tokenizer, batch)
            rewards, _ = score_rewards(
                reward_functions, prompts=[p for p in chunk_prompts for _ in range(G)], completions=completions,
                completion_ids=completion_ids, weights=weights,
                columns={key: [v for v in values for _ in range(G)] for key, values in chunk_columns.items()},
            )
            rows = keep.repeat_interleave(G)
            valid = rows & ~rewards.isnan()
            correct = _counts(rewards, num_prompts=len(chunk), n=G, threshold=correct_threshold)
            prefix = "" if mode == "sampled" else "greedy_"
            sums[f"{prefix}reward_sum"] += torch.where(valid, rewards, 0.0).double().sum()
            sums[f"{prefix}reward_n"] += valid.double().sum()
            if mode == "greedy":
                sums["greedy_correct"] += (correct * keep).double().sum()
                continue
            sums["pass1"] += (pass_at_k(n, correct, 1) * keep).sum()
            sums[f"pass{k}"] += (pass_at_k(n, correct, k) * keep).sum()
            sums["prompts"] += keep.double().sum()
            sums["length"] += (batch.mask.sum(-1).cpu() * rows).double().sum()
            sums["truncated"] += (batch.truncated.cpu() & rows).double().sum()

    total = {key: float(value) for key, value in reduce_metric_sums(sums).items()}

    def ratio(a: str, b: str) -> float:
        return total[a] / total[b] if total[b] else math.nan

    out = {"eval/reward": ratio("reward_sum", "reward_n"), "eval/pass@1": ratio("pass1", "prompts"),
           f"eval/pass@{k}": ratio(f"pass{k}", "prompts")}
    if greedy:
        out["eval/greedy_reward"] = ratio("greedy_reward_sum", "greedy_reward_n")
        out["eval/greedy_accuracy"] = ratio("greedy_correct", "prompts")
    sequences = total["prompts"] * n
    out["eval/mean_length"] = total["length"] / sequences
    out["eval/clipped_ratio"] = total["truncated"] / sequences
    out["eval/num_prompts"] = total["prompts"]
    return out
