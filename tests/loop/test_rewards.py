"""Reward scoring: both kinds of reward function, weights, None, and the error paths."""

import math

import pytest
import torch

from torchforge.trainer.demo import CopyDigitsReward
from torchforge.errors import InvalidArgumentError
from torchforge.loop.rewards import RewardError, RewardFunction, reward_name, score_rewards

PROMPTS = ["12=", "12=", "34="]
COMPLETIONS = ["12", "1", "x"]


class Length(RewardFunction):
    def compute(self, completions, prompts):
        return [float(len(c)) for c in completions]


def starts_with_one(prompts, completions, **kwargs):
    return [1.0 if c.startswith("1") else None for c in completions]


def test_weighted_sum_over_the_functions_that_apply():
    total, parts = score_rewards([Length(), starts_with_one], prompts=PROMPTS, completions=COMPLETIONS,
                                 weights=[0.5, 2.0])
    # row 0: 0.5 * 2 + 2 * 1; row 1: 0.5 * 1 + 2 * 1; row 2: 0.5 * 1 (starts_with_one is None)
    torch.testing.assert_close(total, torch.tensor([3.0, 2.5, 0.5], dtype=torch.float64))  # the functions' floats
    assert list(parts) == ["Length", "starts_with_one"]
    assert torch.isnan(parts["starts_with_one"][2]) and parts["Length"].tolist() == [2.0, 1.0, 1.0]


def test_nan_when_no_function_applies():
    total, _ = score_rewards([starts_with_one], prompts=PROMPTS, completions=COMPLETIONS)
    assert total[:2].tolist() == [1.0, 1.0] and math.isnan(total[2])


def test_callables_get_ids_and_dataset_columns():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(ids=completion_ids, answer=answer)
        return [0.0] * len(completions)

    score_rewards([spy], prompts=PROMPTS, completions=COMPLETIONS, completion_ids=[[1], [2], [3]],
                  columns={"answer": ["a", "a", "b"]})
    assert seen == {"ids": [[1], [2], [3]], "answer": ["a", "a", "b"]}


def test_weight_attribute_and_name():
    class Weighted(Length):
        name = "len"
        weight = 3.0

    total, parts = score_rewards([Weighted()], prompts=PROMPTS, completions=COMPLETIONS)
    assert total.tolist() == [6.0, 3.0, 3.0] and list(parts) == ["len"]
    assert reward_name(starts_with_one) == "starts_with_one"


def test_copy_digits_reward_gives_partial_credit_and_pays_for_stopping():
    # (digits right + stopped after 3 - characters past 3) / 4; without ids, stopped = 3 characters
    assert CopyDigitsReward().compute(["407", "400", "7", "4077"], ["407="] * 4) == [1.0, 0.75, 0.0, 0.5]
    # with the ids: eos (2) right after the copy; a pad (0) that decodes to nothing is not a stop
    ids = [[8, 4, 11, 2], [8, 4, 11, 0], [8, 4, 11, 11]]
    assert CopyDigitsReward().compute(["407", "407", "4077"], ["407="] * 3, completion_ids=ids) == [1.0, 0.75, 0.5]


def test_a_raising_function_is_named():
    def broken(prompts, completions, **kwargs):
        raise KeyError("answer")

    with pytest.raises(RewardError, match=r"score_rewards: reward function 'broken' raised KeyError: 'answer'"):
        score_rewards([broken], prompts=PROMPTS, completions=COMPLETIONS)


@pytest.mark.parametrize(
    "returned, message",
    [
        ([1.0], r"reward function 'bad' returned 1 values for 3 completions; expected a list of 3 floats"),
        (None, r"reward function 'bad' returned None for 3 completions"),
        ([1.0, "yes", 0.0], r"reward function 'bad' returned 'yes' \(a str\) for completion 1; expected a float or None"),
        ([1.0, float("nan"), 0.0], r"reward function 'bad' returned NaN for completion 1; return None"),
        ([True, 1.0, 0.0], r"returned True \(a bool\) for completion 0"),
    ],
)
def test_wrong_returns_stop_with_the_function_named(returned, message):
    def bad(prompts, completions, **kwargs):
        return returned

    with pytest.raises(RewardError, match=message):
        score_rewards([bad], prompts=PROMPTS, completions=COMPLETIONS)


def test_argument_errors():
    with pytest.raises(InvalidArgumentError, match="reward_functions is empty"):
        score_rewards([], prompts=PROMPTS, completions=COMPLETIONS)
    with pytest.raises(InvalidArgumentError, match="2 prompts but 3 completions"):
        score_rewards([Length()], prompts=PROMPTS[:2], completions=COMPLETIONS)
    with pytest.raises(InvalidArgumentError, match="1 weights for 2 reward functions"):
        score_rewards([Length(), starts_with_one], prompts=PROMPTS, completions=COMPLETIONS, weights=[1.0])
    with pytest.raises(NotImplementedError, match="RewardFunction.compute is not implemented"):
        RewardFunction().compute(["a"], ["b"])


# --- guarded reward functions: timeouts and worker processes ------------------------------

import os
import signal
import time
import warnings

from torchforge.loop.rewards import GuardedReward, RewardWorkers, close_rewards, guard_rewards


def grader(prompts, completions, **kwargs):
    """A CPU grader that hangs on "hang", kills its own process on "kill" / "exit", raises on "raise"."""
    out = []
    for c in completions:
        if c == "hang":
            time.sleep(3600)
        elif c == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif c == "exit":
            os._exit(3)
        elif c == "raise":
            raise ValueError("cannot grade this")
        out.append(float(len(c)))
    return out


@pytest.fixture
def workers():
    pool = RewardWorkers(2, preload=[__name__])
    yield pool
    pool.close()


def _quiet(fn, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        return fn(**kwargs), [str(w.message) for w in caught]


def test_a_hang_in_a_worker_costs_that_completion_only(workers):
    guarded = GuardedReward(grader, timeout=1.0, workers=workers, failure_reward=-1.0)
    start = time.monotonic()
    values, messages = _quiet(guarded, prompts=["p"] * 3, completions=["ab", "hang", "abc"])
    assert values == [2.0, -1.0, 3.0]
    assert time.monotonic() - start < 30  # not stuck: the hanging worker was killed after 1 s
    assert guarded.pop_failures() == {"timeouts": 1, "crashes": 0}
    assert guarded.pop_failures() == {"timeouts": 0, "crashes": 0}  # popped
    assert len(messages) == 1 and "'grader' timed out after 1 s on sample 1" in messages[0] and "'hang'" in messages[0]


@pytest.mark.parametrize("completion, reason", [("kill", "killed by SIGKILL"), ("exit", "exit status 3")])
def test_a_grader_that_kills_its_process_costs_that_completion_only(workers, completion, reason):
    guarded = GuardedReward(grader, workers=workers, failure_reward=None)
    values, messages = _quiet(guarded, prompts=["p"] * 3, completions=["a", completion, "abcd"])
    assert values == [1.0, None, 4.0]
    assert guarded.pop_failures() == {"timeouts": 0, "crashes": 1}
    assert f"crashed ({reason}) on sample 1" in messages[0]
    # the pool replaced the dead worker: the next call scores everything
    assert guarded(prompts=["p"] * 2, completions=["xy", "z"]) == [2.0, 1.0]


def test_failures_reach_score_rewards_as_the_failure_reward(workers):
    guarded = GuardedReward(grader, timeout=1.0, workers=workers, failure_reward=None)
    (total, parts), _ = _quiet(score_rewards, reward_functions=[guarded, Length()], prompts=["p"] * 2,
                               completions=["ab", "exit"], weights=[1.0, 10.0])
    assert math.isnan(parts["grader"][1]) and parts["grader"][0] == 2.0
    assert total.tolist() == [22.0, 40.0]  # the failed grader is "not applicable" there


def test_a_grader_that_raises_in_a_worker_still_stops_with_the_sample_named(workers):
    guarded = GuardedReward(grader, workers=workers)
    with pytest.raises(RewardError, match=r"'grader' raised ValueError: cannot grade this on sample 1 "
                                          r"\(prompt 'q', completion 'raise'\)") as info:
        guarded(prompts=["q", "q"], completions=["a", "raise"])
    assert isinstance(info.value.__cause__, ValueError)


def test_a_timeout_without_workers_abandons_the_call_and_fails_its_completions():
    guarded = GuardedReward(grader, timeout=0.5, failure_reward=0.0)
    start = time.monotonic()
    values, messages = _quiet(guarded, prompts=["p"] * 2, completions=["ab", "hang"])
    assert values == [0.0, 0.0] and time.monotonic() - start < 10
    assert guarded.pop_failures() == {"timeouts": 2, "crashes": 0}
    assert "a call on 2 samples" in messages[0]
    assert guarded(prompts=["p"], completions=["abc"]) == [3.0]  # a call within the limit keeps its scores
    with pytest.raises(ValueError, match="cannot grade this"):  # raising is still raising
        guarded(prompts=["p"], completions=["raise"])


def test_guard_rewards_leaves_the_default_path_and_in_process_functions_alone():
    class Model(Length):
        in_process = True

    length, model = Length(), Model()
    assert guard_rewards([length, model]) == [length, model]  # no timeout, no workers: the same objects
    guarded = guard_rewards([length, model], timeout=5.0, processes=1)
    assert isinstance(guarded[0], GuardedReward) and guarded[1] is model
    assert guarded[0].name == "Length" and guarded[0].weight == 1.0
    close_rewards(guarded)


def test_guard_rewards_refuses_what_cannot_reach_a_worker():
    with pytest.raises(InvalidArgumentError, match=r"guard_rewards: reward function '<lambda>' cannot be sent to a "
                                                   r"worker process .*expected a module-level function"):
        guard_rewards([lambda prompts, completions, **kw: [0.0]], processes=1)
    with pytest.raises(InvalidArgumentError, match=r"guard_rewards: processes=-1; expected an int >= 0"):
        guard_rewards([grader], processes=-1)
    with pytest.raises(InvalidArgumentError, match=r"GuardedReward: timeout=0; expected a number of seconds > 0"):
        GuardedReward(grader, timeout=0)
    with pytest.raises(InvalidArgumentError, match=r"GuardedReward: failure_reward=nan; expected a finite number"):
        GuardedReward(grader, failure_reward=math.nan)
    with pytest.raises(InvalidArgumentError, match=r"RewardWorkers: processes=0; expected an int >= 1"):
        RewardWorkers(0)


def test_math_accuracy_grades_in_a_worker(workers):
    from torchforge.rewards import MathAccuracy

    guarded = GuardedReward(MathAccuracy(), timeout=60.0, workers=workers)
    assert guarded(prompts=["q"] * 2, completions=["\\boxed{0.5}", "\\boxed{2}"], answer=["\\frac{1}{2}"] * 2) == [1.0, 0.0]


def hangs_where_asked(prompts, completions, hang, **kwargs):
    """Hangs on the completions of rows with ``hang`` set; 1.0 elsewhere."""
    if any(hang):
        time.sleep(3600)
    return [1.0] * len(completions)


def test_the_trainer_logs_failures_and_keeps_training(tmp_path):
    from torchforge import RLConfig, RLTrainer
    from torchforge.trainer.demo import char_tokenizer, tiny_llama

    config = RLConfig(max_steps=2, num_generations=2, prompts_per_step=2, max_completion_length=3, kl_coef=0.0,
                      mixed_precision="fp32", gradient_checkpointing=False, progress_bar=False,
                      output_dir=str(tmp_path / "run"), reward_timeout=1.0, reward_processes=2,
                      reward_on_failure=-1.0)
    tokenizer = char_tokenizer()
    # two rows, both drawn every step: the "hang" row's two completions time out, the other's score 1
    data = [{"prompt": "123=", "target": "123", "hang": True}, {"prompt": "456=", "target": "456", "hang": False}]
    trainer = RLTrainer(model=tiny_llama(tokenizer), tokenizer=tokenizer, config=config,
                        reward_functions=[hangs_where_asked, CopyDigitsReward()], train_dataset=data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summary = trainer.train()
    rows = trainer.history
    assert summary["steps"] == 2
    assert [r["rewards/hangs_where_asked/timeouts"] for r in rows] == [2.0, 2.0]
    assert [r["rewards/hangs_where_asked/crashes"] for r in rows] == [0.0, 0.0]
    assert [r["rewards/copy_digits/timeouts"] for r in rows] == [0.0, 0.0]  # guarded too, never failed
    assert [r["rewards/hangs_where_asked/mean"] for r in rows] == [0.0, 0.0]  # (-1 -1 +1 +1) / 4


def test_torchforge_train_with_reward_workers_from_a_config(tmp_path):
    import json

    import yaml

    from torchforge.trainer.cli import main
    from torchforge.trainer.demo import char_tokenizer, tiny_llama

    tokenizer = char_tokenizer()
    tiny_llama(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in [{"prompt": "123=", "target": "123", "hang": True},
                                                            {"prompt": "456=", "target": "456", "hang": False}]))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(tmp_path / "model"), "dataset": str(data), "output_dir": str(tmp_path / "run"),
        "reward_functions": ["tests.loop.test_rewards.hangs_where_asked", "torchforge.trainer.demo.CopyDigitsReward"],
        "max_steps": 1, "num_generations": 2, "prompts_per_step": 2, "max_completion_length": 3, "kl_coef": 0.0,
        "mixed_precision": "fp32", "gradient_checkpointing": False, "progress_bar": False,
        "reward_timeout": 1.0, "reward_processes": 1, "reward_on_failure": None}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["train", "--config", str(config)]) == 0
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["rewards/hangs_where_asked/timeouts"] == 2.0 and row["rewards/hangs_where_asked/mean"] == 1.0
    assert row["rewards/copy_digits/crashes"] == 0.0
    assert main(["train", "--config", str(config), "reward_processes=-1", "output_dir=" + str(tmp_path / "r2")]) == 2


def test_a_worker_that_cannot_start_is_an_error_not_a_crash_of_every_sample(tmp_path):
    # a training script without `if __name__ == "__main__":` runs again in every worker (which imports
    # the main module), and fails there: that is named, not scored as crashed completions
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import sys\n"
        "from torchforge.loop.rewards import GuardedReward, RewardWorkers\n"
        "def length(prompts, completions, **kw):\n"
        "    return [float(len(c)) for c in completions]\n"
        "print(GuardedReward(length, workers=RewardWorkers(1))(prompts=['p'], completions=['ab']))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode != 0
    assert "RewardError: RewardWorkers: a worker process exited with status 1 before calling 'length'" in done.stderr
    assert "if __name__ == '__main__':" in done.stderr
    guarded = script.read_text().replace("print(", "if __name__ == '__main__':\n    print(")
    script.write_text(guarded)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0 and done.stdout.strip() == "[2.0]", done.stderr[-2000:]
