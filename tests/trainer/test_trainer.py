"""RLTrainer, RLConfig and the algorithms on the tiny local Llama (CPU, a few steps each)."""

import math
import warnings

import pytest
import torch

from torchforge.trainer.config import RLConfig
from torchforge.trainer.demo import CopyDigitsReward, char_tokenizer, copy_digits_dataset, demo_config, tiny_llama
from torchforge.distributed import DistributedConfig
from torchforge.errors import InvalidArgumentError
from torchforge.loop.rewards import RewardFunction
from torchforge.trainer.trainer import RLTrainer


def small_config(tmp_path, **overrides):
    values = dict(max_steps=2, num_generations=4, prompts_per_step=4, max_completion_length=4,
                  kl_coef=0.05, progress_bar=False, output_dir=str(tmp_path / "run"), learning_rate=1e-2)
    values.update(overrides)
    return demo_config(**values)


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.modules.named_parameters()}


# --- smoke: every algorithm learns something and logs finite numbers ------------------------

@pytest.mark.parametrize("algorithm, extra", [
    ("grpo", {}),
    ("grpo", dict(loss_aggregation="seq-mean-token-sum-norm", advantage_scale="none", num_iterations=2)),
    ("ppo", dict(num_iterations=2, micro_batch_size=8)),
    ("reinforce", dict(reinforce_baseline="rloo")),
    ("reinforce", dict(reinforce_baseline="reinforce++")),
    ("reinforce", dict(reinforce_baseline="reinforce++-baseline")),
])
def test_a_few_steps_change_the_parameters_and_log_finite_metrics(tmp_path, algorithm, extra):
    trainer = RLTrainer(config=small_config(tmp_path, algorithm=algorithm, **extra))
    before = _params(trainer)
    summary = trainer.train()
    after = _params(trainer)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert any(n.startswith("policy.") for n in changed)
    if algorithm == "ppo":
        assert any(n.startswith("critic.") for n in changed)
    assert len(trainer.history) == 2
    for row in trainer.history:
        for key, value in row.items():
            assert math.isfinite(value), (key, value)
    for key in ("reward", "reward_std", "rewards/copy_digits/mean", "frac_reward_zero_std", "kl", "entropy",
                "completions/mean_length", "completions/max_length", "completions/clipped_ratio", "loss",
                "grad_norm", "learning_rate", "tokens_per_second", "step_time"):
        assert key in trainer.history[0], key
    assert summary["steps"] == 2 and summary["final_model"].joinpath("config.json").exists()
    assert summary["plot"].exists() and summary["metrics"].exists()


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_the_first_ratio_is_exactly_one(tmp_path, algorithm):
    # GRPO takes old_log_probs from the training forward itself; PPO recomputes them with a
    # no-grad forward over the same micro-batches: either way the first ratio is exactly 1.
    trainer = RLTrainer(config=small_config(tmp_path, algorithm=algorithm, max_steps=1, micro_batch_size=8))
    metrics = trainer.train_step(0)
    assert metrics["ratio_min"] == 1.0 and metrics["ratio_max"] == 1.0
    assert metrics["clip_frac_low"] == 0.0 and metrics["clip_frac_high"] == 0.0


def test_extreme_metrics_are_the_max_and_min_over_micro_batches(tmp_path):
    # ratio_max / ratio_min of a step are the max / min over its micro-batches, not their
    # token-weighted mean; the other metrics stay token-weighted means.
    from torchforge.trainer.algorithms import GRPO

    seen = []

    class Spy(GRPO):
        def compute_loss(self, batch):
            loss, metrics = super().compute_loss(batch)
            seen.append((int(batch.mask.sum()), {k: v.item() for k, v in metrics.items()}))
            return loss, metrics

    config = small_config(tmp_path, max_steps=1, micro_batch_size=8, num_iterations=2, kl_coef=0.0)
    metrics = RLTrainer(algorithm=Spy(), config=config).train_step(0)
    assert len(seen) == 4
    second_pass = seen[2:]  # after one update: the ratios move away from 1
    maxima = [m["ratio_max"] for _, m in second_pass]
    minima = [m["ratio_min"] for _, m in second_pass]
    assert maxima[0] != maxima[1] and minima[0] != minima[1]
    assert metrics["ratio_max"] == max(maxima) and metrics["ratio_min"] == min(minima)
    tokens = [n for n, _ in second_pass]
    mean = sum(n * m["ratio_mean"] for n, m in second_pass) / sum(tokens)
    assert metrics["ratio_mean"] == pytest.approx(mean, rel=1e-6)


def test_entropy_coef_subtracts_the_aggregated_entropy(tmp_path):
    # token-mean over the whole step: the bonus is exactly entropy_coef * the logged (token-mean)
    # entropy, and it changes the gradient
    runs = {}
    for coef in (0.0, 0.5):
        trainer = RLTrainer(config=small_config(tmp_path / str(coef), max_steps=1, entropy_coef=coef, kl_coef=0.0))
        runs[coef] = trainer.train_step(0)
    assert runs[0.5]["entropy"] == runs[0.0]["entropy"] > 0
    assert runs[0.5]["loss"] == pytest.approx(runs[0.0]["loss"] - 0.5 * runs[0.0]["entropy"], rel=1e-5, abs=1e-6)
    assert runs[0.5]["grad_norm"] != pytest.approx(runs[0.0]["grad_norm"], rel=1e-3)


def test_mask_truncated_completions_count_for_nothing(tmp_path):
    # a truncated completion leaves the mask and its reward is NaN for the group statistics
    # (advantage 0, the group's mean and std from the others); the logged rewards and lengths
    # stay those of the sampled batch
    from torchforge.advantages import group_advantages
    from torchforge.trainer.algorithms import GRPO

    seen = {}

    class Spy(GRPO):
        def prepare(self, batch):
            super().prepare(batch)
            seen[self.config.mask_truncated_completions] = batch.clone()

    metrics = {}
    for flag in (False, True):
        config = small_config(tmp_path / str(flag), max_steps=1, kl_coef=0.0, mask_truncated_completions=flag)
        metrics[flag] = RLTrainer(algorithm=Spy(), config=config).train_step(0)
    sampled, counted = seen[False], seen[True]
    truncated = counted.truncated
    assert 0 < int(truncated.sum()) < len(truncated)
    assert torch.equal(counted.mask, sampled.mask & ~truncated[:, None])
    assert counted.rewards[truncated].isnan().all()
    assert torch.equal(counted.rewards[~truncated], sampled.rewards[~truncated])
    assert (counted.advantages[truncated] == 0).all()
    torch.testing.assert_close(counted.advantages, group_advantages(counted.rewards, group_size=4))
    assert not torch.equal(counted.advantages, sampled.advantages)
    for key in ("reward", "completions/mean_length", "completions/clipped_ratio"):  # the logs: as sampled
        assert metrics[True][key] == metrics[False][key], key
    # the groups without signal: those of the update, where a truncated completion has no reward
    from torchforge.advantages import zero_std_groups

    for flag, batch in ((False, sampled), (True, counted)):
        expected = zero_std_groups(batch.rewards, group_size=4).float().mean().item()
        assert metrics[flag]["frac_reward_zero_std"] == pytest.approx(expected, abs=1e-12), flag


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_micro_batch_size_does_not_change_the_update(tmp_path, monkeypatch, algorithm):
    # nor the logged metrics: token means are weighted by tokens, extrema are extrema, and
    # PPO's pg_loss / value_loss (terms of the loss, computed with the step's global counts)
    # add up over micro-batches as the loss does
    import torchforge.trainer.trainer as trainer_module

    grads = []

    def recording_step(parameters, *args, **kwargs):
        grads.append([p.grad.clone() for p in parameters])
        return optimizer_step(parameters, *args, **kwargs)

    optimizer_step = trainer_module.optimizer_step
    monkeypatch.setattr(trainer_module, "optimizer_step", recording_step)
    logged = []
    for micro in (None, 4, 8):
        trainer = RLTrainer(config=small_config(tmp_path / str(micro), max_steps=1, micro_batch_size=micro,
                                                loss_aggregation="seq-mean-token-mean", algorithm=algorithm))
        logged.append(trainer.train_step(0))
    timing = {"step_time", "tokens_per_second"}
    if algorithm == "ppo":
        assert logged[0]["pg_loss"] + 0.5 * logged[0]["value_loss"] == pytest.approx(logged[0]["loss"], rel=1e-5)
    for metrics, step_grads in zip(logged[1:], grads[1:]):
        assert metrics.keys() == logged[0].keys()
        for key in metrics.keys() - timing:
            assert metrics[key] == pytest.approx(logged[0][key], rel=1e-5, abs=1e-6), key
        for got, expected in zip(step_grads, grads[0]):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-7)


def test_resume_gives_the_same_losses_and_rewards_as_an_uninterrupted_run(tmp_path):
    full = RLTrainer(config=small_config(tmp_path / "full", max_steps=4))
    full.train()
    first = RLTrainer(config=small_config(tmp_path / "cut", max_steps=2))
    first.train()
    resumed = RLTrainer(config=small_config(tmp_path / "cut", max_steps=4, resume=True))
    resumed.train()
    assert [h["step"] for h in resumed.history] == [3, 4]
    for expected, got in zip(full.history[2:], resumed.history):
        for key in ("reward", "loss", "kl", "entropy", "grad_norm"):
            assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    for (name, a), b in zip(full.modules.named_parameters(), resumed.modules.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)


def test_resume_without_a_checkpoint_warns_and_starts_at_zero(tmp_path):
    trainer = RLTrainer(config=small_config(tmp_path, max_steps=1, resume=True))
    with pytest.warns(UserWarning, match="holds no checkpoint; starting from step 0"):
        trainer.train()
    assert trainer.step == 1


def test_the_final_model_loads_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = RLTrainer(config=small_config(tmp_path, max_steps=1, kl_coef=0.0))
    summary = trainer.train()
    loaded = AutoModelForCausalLM.from_pretrained(summary["final_model"])
    AutoTokenizer.from_pretrained(summary["final_model"])
    ids = torch.tensor([[5, 6, 7, 14]])
    torch.testing.assert_close(loaded(ids).logits, trainer.model(ids).logits)


# --- the data ------------------------------------------------------------------------------

def test_dataset_columns_reach_trl_style_reward_functions(tmp_path):
    seen = []

    def exact_copy(prompts, completions, target, **kwargs):
        seen.extend(target)
        return [float(c == t) for c, t in zip(completions, target)]

    tokenizer = char_tokenizer()
    trainer = RLTrainer(model=tiny_llama(tokenizer), tokenizer=tokenizer, config=small_config(tmp_path, max_steps=1),
                        reward_functions=[exact_copy, CopyDigitsReward()], train_dataset=copy_digits_dataset(8))
    metrics = trainer.train_step(0)
    assert len(seen) == 16 and all(len(t) == 3 for t in seen)
    assert "rewards/exact_copy/mean" in metrics and "rewards/copy_digits/mean" in metrics


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_the_learning_rate_schedule_counts_steps_not_optimizer_steps(tmp_path, num_iterations):
    # linear over 4 steps after 1 warm-up step: every optimizer step of a step uses that
    # step's rate (it ran num_iterations times faster, reaching 0 halfway, at 2), and the
    # logged learning_rate is the one used
    config = small_config(tmp_path, max_steps=4, num_iterations=num_iterations, lr_scheduler="linear",
                          warmup_steps=1, learning_rate=0.1)
    trainer = RLTrainer(config=config)
    used = []
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        used.append(trainer.optimizer.param_groups[0]["lr"])
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    logged = [trainer.train_step(s)["learning_rate"] for s in range(4)]
    expected = [0.1 * f for f in (0.5, 1.0, 2 / 3, 1 / 3)]
    assert used == pytest.approx([lr for lr in expected for _ in range(num_iterations)], rel=1e-12)
    assert logged == pytest.approx(expected, rel=1e-12)


def test_rewards_reach_the_advantages_unrounded_at_an_offset_of_1e4(tmp_path):
    # near 1e4 float32 steps by 1e-3: rewards 1e4 + {0, 0.01, 0.02, 0.03} held in float32
    # gave advantages up to 0.03 off; the rewards stay float64 up to the group statistics
    from torchforge.advantages import group_advantages
    from torchforge.trainer.algorithms import GRPO

    seen = {}

    class Spy(GRPO):
        def prepare(self, batch):
            super().prepare(batch)
            seen["advantages"] = batch.advantages.clone()

    class Offset(RewardFunction):
        name = "offset"

        def compute(self, completions, prompts):
            return [1e4 + 0.01 * (i % 4) for i in range(len(completions))]

    tokenizer = char_tokenizer()
    trainer = RLTrainer(model=tiny_llama(tokenizer), tokenizer=tokenizer, algorithm=Spy(),
                        config=small_config(tmp_path, max_steps=1), reward_functions=[Offset()],
                        train_dataset=copy_digits_dataset(8))
    trainer.train_step(0)
    expected = group_advantages(0.01 * (torch.arange(16) % 4).double(), group_size=4)
    torch.testing.assert_close(seen["advantages"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("offset", [0.0, 1e2, 1e4])
def test_logged_reward_std_is_the_spread_of_the_rewards_at_any_offset(tmp_path, offset):
    # Rewards offset + {0, 0.1, 0.2, 0.3}, as float32 holds them. Formed as
    # sum(r^2) / n - mean^2 in float32 their std was 5% off at 1e2 and 0 at 1e4; the
    # trainer takes it from deviations about the mean (reduce.masked_var).
    seen = []

    class Spread(RewardFunction):
        name = "spread"

        def compute(self, completions, prompts):
            rewards = [offset + 0.1 * (i % 4) for i in range(len(completions))]
            seen.extend(rewards)
            return rewards

    tokenizer = char_tokenizer()
    trainer = RLTrainer(model=tiny_llama(tokenizer), tokenizer=tokenizer, config=small_config(tmp_path, max_steps=1),
                        reward_functions=[Spread()], train_dataset=copy_digits_dataset(8))
    metrics = trainer.train_step(0)
    expected = torch.tensor(seen).double()  # float32, as the trainer holds rewards
    assert len(seen) == 16
    for mean_key, std_key in (("reward", "reward_std"), ("rewards/spread/mean", "rewards/spread/std")):
        assert metrics[mean_key] == pytest.approx(expected.mean().item(), rel=1e-7)
        assert metrics[std_key] == pytest.approx(expected.std().item(), rel=1e-6)


def test_chat_prompts_use_the_chat_template(tmp_path):
    tokenizer = char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    data = [{"prompt": [{"role": "user", "content": "123"}]}] * 4
    seen = []

    class Spy(RewardFunction):
        def compute(self, completions, prompts):
            seen.extend(prompts)
            return [0.0] * len(completions)

    trainer = RLTrainer(model=tiny_llama(tokenizer), tokenizer=tokenizer, config=small_config(tmp_path),
                        reward_functions=[Spy()], train_dataset=data)
    trainer.train_step(0)
    assert set(seen) == {"123="}
    tokenizer.chat_template = None
    with pytest.raises(InvalidArgumentError, match="a prompt is a list of chat messages but the tokenizer has no chat_template"):
        trainer.train_step(1)


def test_data_order_is_a_seeded_permutation_per_epoch(tmp_path):
    tokenizer = char_tokenizer()
    data = copy_digits_dataset(8, seed=3)
    trainer = RLTrainer(model=tiny_llama(tokenizer), tokenizer=tokenizer, config=small_config(tmp_path),
                        reward_functions=[CopyDigitsReward()], train_dataset=data)
    epoch = [row for step in range(2) for row in trainer._rows(step)[0]]
    assert sorted(r["prompt"] for r in epoch) == sorted(r["prompt"] for r in data)
    assert trainer._rows(2)[1] == [8, 9, 10, 11]  # the stream continues into the next epoch


# --- the product card ----------------------------------------------------------------------

def test_card_quick_start_runs_as_written(tmp_path):
    # SEED.md's quick start with the tiny local model in place of Llama-3.1-8B
    tokenizer = char_tokenizer()
    model = tiny_llama(tokenizer)
    dataset = [{"prompt": p} for p in ["12=", "345=", "6=", "78="]] * 2

    class FormatReward(RewardFunction):
        def compute(self, completions, prompts):
            rewards = []
            for c in completions:
                if "<answer>" in c and "</answer>" in c:
                    rewards.append(1.0)
                else:
                    rewards.append(-0.5)
            return rewards

    config = RLConfig(
        algorithm="grpo",
        learning_rate=1e-6,
        num_generations=4,
        max_completion_length=512,
        output_dir=str(tmp_path / "torchforge-output"),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = RLTrainer(
            model=model,
            tokenizer=tokenizer,
            config=config,
            reward_functions=[FormatReward()],
            train_dataset=dataset,
        )
        trainer.train()
    assert any("mixed_precision='bf16' needs a GPU" in str(w.message) for w in caught)
    assert trainer.step == 1 and trainer.history[0]["reward"] == -0.5
    assert trainer.history[0]["frac_reward_zero_std"] == 1.0  # every group all-equal: advantages 0


def test_trainer_argument_errors():
    tokenizer = char_tokenizer()
    with pytest.raises(InvalidArgumentError, match="RLTrainer: tokenizer is None"):
        RLTrainer(model=tiny_llama(tokenizer), reward_functions=[CopyDigitsReward()], train_dataset=[{"prompt": "1="}])
    with pytest.raises(InvalidArgumentError, match=r"train_dataset rows have fields \['question'\]; expected a 'prompt' field"):
        RLTrainer(model=tiny_llama(tokenizer), tokenizer=tokenizer, reward_functions=[CopyDigitsReward()],
                  train_dataset=[{"question": "1="}])
    with pytest.raises(InvalidArgumentError, match="reward_functions is empty"):
        RLTrainer(model=tiny_llama(tokenizer), tokenizer=tokenizer, reward_functions=[], train_dataset=[{"prompt": "1="}])
    with pytest.raises(InvalidArgumentError, match="config is a dict; expected an RLConfig"):
        RLTrainer(config={"max_steps": 1})


@pytest.mark.slow
def test_grpo_learns_the_default_task(tmp_path):
    trainer = RLTrainer(config=demo_config(output_dir=str(tmp_path / "run"), progress_bar=False))
    summary = trainer.train()
    assert summary["reward_last"] - summary["reward_first"] >= 0.3, summary


def test_distributed_config_activation_checkpointing_wraps_the_blocks(tmp_path):
    trainer = RLTrainer(config=small_config(tmp_path, gradient_checkpointing=False),
                        distributed_config=DistributedConfig(strategy="none", activation_checkpointing=True))
    wrapped = [m for m in trainer.model.modules() if type(m).__name__ == "CheckpointWrapper"]
    assert len(wrapped) == 2  # both decoder blocks
    assert math.isfinite(trainer.train_step(0)["loss"])
