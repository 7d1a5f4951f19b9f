"""Evaluation: pass@k against the combinatorial formula, evaluate's counts on hand-set rewards,
greedy decoding, and 2 processes (gloo, FSDP2 and plain) reporting what 1 does.

This file is also the 2-process worker: ``python tests/loop/test_evaluate.py OUT STRATEGY``.
"""

from __future__ import annotations

import math
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchforge.errors import InvalidArgumentError
from torchforge.loop.evaluate import evaluate, pass_at_k


def _pass_at_k_comb(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k), in exact rational arithmetic."""
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


# --- pass@k --------------------------------------------------------------------------------

def test_pass_at_k_hand_cases():
    # n=5, c=2, k=2: 1 - C(3, 2) / C(5, 2) = 1 - 3/10 = 0.7; k=1 is c/n; n - c < k gives 1
    assert float(pass_at_k(5, 2, 2)) == pytest.approx(0.7, abs=1e-15)
    torch.testing.assert_close(pass_at_k(4, torch.tensor([0, 1, 2, 3, 4]), 1),
                               torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64), rtol=0, atol=1e-15)
    assert float(pass_at_k(4, 2, 3)) == 1.0 and float(pass_at_k(4, 0, 4)) == 0.0


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 60), data=st.data())
def test_pass_at_k_matches_the_combinatorial_formula(n, data):
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    assert float(pass_at_k(n, c, k)) == pytest.approx(_pass_at_k_comb(n, c, k), rel=1e-12, abs=1e-14)


def test_pass_at_k_vectorized_and_stable_for_large_n():
    n, k = torch.tensor([1000, 200, 7]), 100
    c = torch.tensor([3, 0, 7])
    got = pass_at_k(n, c, 5)
    for i in range(3):
        assert float(got[i]) == pytest.approx(_pass_at_k_comb(int(n[i]), int(c[i]), 5), rel=1e-12)
    # C(3000, 500) does not fit a float64, so the ratio of binomials cannot be formed in floats;
    # the product form needs no binomial
    with pytest.raises(OverflowError):
        float(math.comb(3000, 500))
    assert float(pass_at_k(3000, 5, 500)) == pytest.approx(_pass_at_k_comb(3000, 5, 500), rel=1e-10)
    assert float(pass_at_k(2000, 5, k)) == pytest.approx(_pass_at_k_comb(2000, 5, k), rel=1e-10)


@pytest.mark.parametrize("args, message", [
    ((4, 5, 1), r"pass_at_k: c must be in \[0, n\]; got c=5 with n=4"),
    ((4, -1, 1), r"pass_at_k: c must be in \[0, n\]"),
    ((4, 2, 0), "pass_at_k: k must be an int >= 1, got 0"),
    ((4, 2, 5), r"pass_at_k: k=5 is more than the samples n=4; expected k <= n"),
    ((4.0, 2, 1), "pass_at_k: n has dtype torch.float32; expected integers"),
])
def test_pass_at_k_errors(args, message):
    with pytest.raises(InvalidArgumentError, match=message):
        pass_at_k(*args)


# --- evaluate on the tiny model -------------------------------------------------------------

class Scripted:
    """A reward function returning preset values, one list per call (sampled, then greedy)."""

    name = "scripted"

    def __init__(self, *calls):
        self.calls, self.seen = list(calls), []

    def __call__(self, *, prompts, completions, **columns):
        self.seen.append((list(prompts), list(completions), columns))
        return self.calls.pop(0)


def test_evaluate_counts_on_hand_set_rewards(model, tokenizer):
    # 2 prompts x n=4 samples. prompt 0: rewards 1, 0, 1, 0.5 -> c=2 (threshold 1);
    # prompt 1: 0, 0, None, 0 -> c=0. pass@1 = (2/4 + 0) / 2 = 0.25;
    # pass@2 = (1 - C(2,2)/C(4,2) + 0) / 2 = (5/6) / 2; reward = 2.5 / 7 (None left out).
    # greedy: 1.0 and 0.0 -> accuracy 0.5, reward 0.5.
    fn = Scripted([1.0, 0.0, 1.0, 0.5, 0.0, 0.0, None, 0.0], [1.0, 0.0])
    out = evaluate(model, tokenizer, ["12=", "7="], [fn], num_generations=4, k=2, max_new_tokens=3,
                   columns={"answer": ["12", "7"]})
    assert out["eval/pass@1"] == pytest.approx(0.25, abs=1e-12)
    assert out["eval/pass@2"] == pytest.approx(5 / 12, abs=1e-12)
    assert out["eval/reward"] == pytest.approx(2.5 / 7, abs=1e-7)
    assert out["eval/greedy_accuracy"] == 0.5 and out["eval/greedy_reward"] == 0.5
    assert out["eval/num_prompts"] == 2.0
    # the columns reach the reward function once per completion, in groups
    (prompts, _, columns), (greedy_prompts, _, greedy_columns) = fn.seen
    assert prompts == ["12="] * 4 + ["7="] * 4 and columns["answer"] == ["12"] * 4 + ["7"] * 4
    assert greedy_prompts == ["12=", "7="] and greedy_columns["answer"] == ["12", "7"]


def test_evaluate_threshold_is_configurable(model, tokenizer):
    fn = Scripted([1.0, 0.0, 1.0, 0.5, 0.0, 0.0, None, 0.0])
    out = evaluate(model, tokenizer, ["12=", "7="], [fn], num_generations=4, max_new_tokens=3,
                   correct_threshold=0.5, greedy=False)
    # prompt 0 now has c=3: pass@1 = 3/8, pass@4 = 1/2 (prompt 1 none correct)
    assert out["eval/pass@1"] == pytest.approx(3 / 8) and out["eval/pass@4"] == pytest.approx(0.5)
    assert "eval/greedy_reward" not in out


def test_greedy_completion_is_the_argmax_decode(model, tokenizer):
    fn = Scripted([0.0] * 2, [0.0] * 2)
    evaluate(model, tokenizer, ["12=", "345="], [fn], num_generations=1, max_new_tokens=5)
    greedy = fn.seen[1][1]
    for prompt, completion in zip(["12=", "345="], greedy):
        ids = tokenizer([prompt], return_tensors="pt", add_special_tokens=True)["input_ids"]
        out = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        assert completion == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_evaluate_batches_give_the_same_numbers(model, tokenizer):
    from torchforge.trainer.demo import CopyDigitsReward

    prompts = ["12=", "7=", "345=", "9=", "60="]
    kwargs = {"num_generations": 3, "max_new_tokens": 4, "correct_threshold": 0.5, "seed": 5}
    whole = evaluate(model, tokenizer, prompts, [CopyDigitsReward()], **kwargs)
    split = evaluate(model, tokenizer, prompts, [CopyDigitsReward()], batch_size=2, **kwargs)
    assert whole == pytest.approx(split, rel=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_generations": 0}, "evaluate: num_generations must be an int >= 1, got 0"),
    ({"num_generations": 2, "k": 3}, r"evaluate: k must be an int in \[1, num_generations=2\], got 3"),
    ({"num_generations": 2, "batch_size": 0}, "evaluate: batch_size must be an int >= 1 or None, got 0"),
    ({"num_generations": 2, "columns": {"answer": ["1"]}},
     r"evaluate: columns\['answer'\] has 1 values for 2 prompts; expected one per prompt"),
    ({"num_generations": 2, "images": [[]]}, r"evaluate: 1 image lists for 2 prompts; expected one per prompt"),
])
def test_evaluate_errors(model, tokenizer, kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        evaluate(model, tokenizer, ["1=", "2="], [Scripted()], max_new_tokens=2, **kwargs)
    with pytest.raises(InvalidArgumentError, match="evaluate: prompts is empty"):
        evaluate(model, tokenizer, [], [Scripted()], num_generations=1, max_new_tokens=2)


# --- 2 processes -----------------------------------------------------------------------------

PROMPTS = ["12=", "7=", "345=", "9=", "60="]  # 5 prompts: 3 on rank 0, 2 (+1 padding) on rank 1


def _eval_run(strategy: str) -> dict:
    from torchforge.distributed import shard
    from torchforge.trainer.demo import CopyDigitsReward, char_tokenizer, tiny_llama

    tokenizer = char_tokenizer()
    model = tiny_llama(tokenizer, seed=3)
    if strategy != "none":
        model = shard(model, strategy=strategy)
    return evaluate(model, tokenizer, PROMPTS, [CopyDigitsReward()], num_generations=4, k=2, max_new_tokens=4,
                    correct_threshold=0.5, seed=11, batch_size=2)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_evaluate_on_two_processes_matches_one(tmp_path, strategy):
    from torchforge.distributed import launch

    one = _eval_run("none")
    assert launch(2, [__file__, str(tmp_path), strategy], module=None) == 0
    per_rank = [torch.load(tmp_path / f"eval_rank{r}.pt", weights_only=False) for r in range(2)]
    assert per_rank[0] == per_rank[1]                       # every process reports the same figures
    assert per_rank[0] == pytest.approx(one, rel=1e-6)      # and they are those of one process
    assert per_rank[0]["eval/num_prompts"] == 5.0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from torchforge.distributed import end_process, init_distributed, rank, teardown_distributed

    torch.set_num_threads(1)
    assert init_distributed()
    try:
        result = _eval_run(sys.argv[2])
        torch.save(result, Path(sys.argv[1]) / f"eval_rank{rank()}.pt")
    finally:
        teardown_distributed()
    end_process(0)  # every result is written: skip the shutdown where gloo can abort
