"""RLTrainer, RLConfig and the algorithms on the tiny local Llama (CPU, a few steps each)."""

import math

import pytest
import torch

from torchforge.trainer.algorithms import GRPO, PPO, REINFORCE, Algorithm
from torchforge.distributed import DistributedConfig
from torchforge.errors import TorchforgeError
from torchforge.trainer.trainer import RLTrainer
from tests.trainer.test_trainer import _params, small_config



def test_card_custom_algorithm_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    calls = []

    class CustomAlgorithm(Algorithm):
        def compute_loss(self, batch):
            advantages = self.compute_advantages(batch.rewards)
            calls.append((batch.batch_size[0], self.mask.shape, advantages.shape))
            return self.policy_gradient_loss(batch.log_probs, advantages)

    with pytest.warns(UserWarning, match=r"DistributedConfig\(num_gpus=4\) but this run has 1 process"):
        trainer = RLTrainer(
            algorithm=CustomAlgorithm(),
            distributed_config=DistributedConfig(
                strategy="fsdp",
                num_gpus=4,
            )
        )
    trainer.config.max_completion_length = 8  # one short step, to show the loss path works
    metrics = trainer.train_step(0)
    B = trainer.config.prompts_per_step * trainer.config.num_generations
    assert calls == [(B, torch.Size([B, calls[0][1][1]]), torch.Size([B]))]
    assert math.isfinite(metrics["loss"]) and metrics["ratio_max"] == 1.0


def test_custom_algorithm_matches_grpo_without_kl(tmp_path):
    class CustomAlgorithm(Algorithm):
        def compute_loss(self, batch):
            advantages = self.compute_advantages(batch.rewards)
            return self.policy_gradient_loss(batch.log_probs, advantages)

    losses = []
    for algorithm in (CustomAlgorithm(), GRPO()):
        trainer = RLTrainer(algorithm=algorithm, config=small_config(tmp_path, max_steps=1, kl_coef=0.0))
        losses.append((trainer.train_step(0)["loss"], _params(trainer)))
    assert losses[0][0] == pytest.approx(losses[1][0], abs=1e-7)
    for name, value in losses[0][1].items():
        torch.testing.assert_close(value, losses[1][1][name], msg=name)


def test_algorithm_helpers_outside_compute_loss_raise():
    with pytest.raises(TorchforgeError, match=r"Algorithm.mask is only available inside compute_loss"):
        Algorithm().mask


def test_compute_loss_must_return_loss_and_metrics(tmp_path):
    # one contract: compute_loss returns (loss, metrics), as every loss does; anything else
    # (a per-token tensor, or a bare scalar loss) is an error that names what came back
    class Bad(Algorithm):
        def compute_loss(self, batch):
            return batch.log_probs

    class BareLoss(Algorithm):
        def compute_loss(self, batch):
            return self.policy_gradient_loss(batch.log_probs, self.compute_advantages(batch.rewards))[0]

    class PerTokenLoss(Algorithm):
        def compute_loss(self, batch):
            return batch.log_probs, {}

    expected = r"; expected \(loss, metrics\): a scalar tensor and a dict, as every torchforge loss returns"
    for algorithm, seen in [(Bad(), r"Bad.compute_loss returned Tensor of shape \(16, \d+\)"),
                            (BareLoss(), r"BareLoss.compute_loss returned Tensor of shape \(\)"),
                            (PerTokenLoss(), r"PerTokenLoss.compute_loss returned \(Tensor of shape \(16, \d+\), dict\)")]:
        trainer = RLTrainer(algorithm=algorithm, config=small_config(tmp_path))
        with pytest.raises(TorchforgeError, match=seen + expected):
            trainer.train_step(0)


def test_policy_gradient_loss_returns_loss_and_metrics_as_ppo_loss(tmp_path):
    from torchforge.losses import ppo_loss

    seen = []

    class Spy(Algorithm):
        def compute_loss(self, batch):
            advantages = self.compute_advantages(batch.rewards)
            out = self.policy_gradient_loss(batch.log_probs, advantages)
            seen.append((out, ppo_loss(batch.log_probs, batch.old_log_probs, advantages, batch.mask,
                                       aggregation=self.aggregation)))
            return out

    RLTrainer(algorithm=Spy(), config=small_config(tmp_path, kl_coef=0.0)).train_step(0)
    (loss, metrics), (expected_loss, expected_metrics) = seen[0]
    assert torch.equal(loss, expected_loss) and metrics.keys() == expected_metrics.keys()


def test_capability_flags_are_bools_and_each_algorithm_has_its_own_config(tmp_path):
    a, b = GRPO(), GRPO()
    a.config.kl_coef = 0.0  # per instance: changing one algorithm's default config leaves the other's
    assert b.config.kl_coef == 0.1 and Algorithm._config is None
    assert (a.needs_reference, b.needs_reference) == (False, True)
    assert PPO().needs_old_log_probs_in_prepare is True and GRPO().needs_old_log_probs_in_prepare is False
    assert REINFORCE().needs_old_log_probs_in_prepare is False  # rloo: no KL in the reward

    class NeedsReference(Algorithm):
        needs_reference = True  # a class attribute is a flag too

    trainer = RLTrainer(algorithm=NeedsReference(), config=small_config(tmp_path, kl_coef=0.0))
    assert trainer.ref_model is not None

    class MethodFlag(Algorithm):
        def needs_reference(self):  # the old spelling: a method is not a flag
            return True

    with pytest.raises(TorchforgeError, match=r"MethodFlag.needs_reference is method; expected a bool"):
        RLTrainer(algorithm=MethodFlag(), config=small_config(tmp_path, kl_coef=0.0))


# --- configuration errors ------------------------------------------------------------------

@pytest.mark.parametrize("algorithm, cls", [("grpo", GRPO), ("ppo", PPO), ("reinforce", REINFORCE)])
def test_algorithm_by_name(tmp_path, algorithm, cls):
    trainer = RLTrainer(config=small_config(tmp_path, algorithm=algorithm))
    assert type(trainer.algorithm) is cls
    assert (trainer.ref_model is not None) == (trainer.config.kl_coef > 0)


# --- learning (slow) -----------------------------------------------------------------------

def test_a_subclass_init_need_not_call_super(tmp_path):
    class WithInit(Algorithm):
        def __init__(self, scale):
            self.scale = scale

        def compute_loss(self, batch):
            self.log(scale=self.scale)
            loss, metrics = self.policy_gradient_loss(batch.log_probs, self.compute_advantages(batch.rewards))
            return self.scale * loss, metrics

    trainer = RLTrainer(algorithm=WithInit(2.0), config=small_config(tmp_path, kl_coef=0.0))
    metrics = trainer.train_step(0)
    assert metrics["scale"] == 2.0 and "clip_frac_low" in metrics
    assert Algorithm._metrics is None and Algorithm._config is None  # nothing leaked into the class


# --- global statistics: 2 processes equal 1 ------------------------------------------------

@pytest.mark.parametrize("settings", [
    ["algorithm=reinforce", "reinforce_baseline=reinforce++"],
    ["algorithm=reinforce", "reinforce_baseline=reinforce++-baseline"],
    ["algorithm=grpo", "advantage_scale=batch"],
])
def test_whitening_and_batch_scale_use_every_process(tmp_path, settings):
    # REINFORCE++ whitens the returns and advantage_scale="batch" divides by the reward std
    # with the statistics of every process (sum_over_ranks): each process alone would whiten
    # its own half with other statistics, and the losses and gradients would differ.
    import json

    from torchforge.trainer.cli import main

    common = ["max_steps=2", "prompts_per_step=4", "num_generations=4", "kl_coef=0.05", "progress_bar=false",
              "distributed_strategy=ddp", "loss_aggregation=seq-mean-token-mean", "learning_rate=1e-2", *settings]
    runs = {}
    for name, nproc in (("one", []), ("two", ["--nproc", "2"])):
        assert main(["train", *nproc, *common, f"output_dir={tmp_path / name}"]) == 0
        runs[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in runs["two"]] == [1, 2]
    for a, b in zip(runs["one"], runs["two"]):
        assert a["grad_norm"] > 0
        for key in ("loss", "reward", "kl", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
