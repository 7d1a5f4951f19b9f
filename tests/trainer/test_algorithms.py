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
    runs = _one_and_two_processes(tmp_path, settings)
    for a, b in zip(runs["one"], runs["two"]):
        assert a["grad_norm"] > 0
        for key in ("loss", "reward", "kl", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)


def test_ratio_extremes_are_the_max_and_min_over_processes(tmp_path):
    # the second pass's ratio_max / ratio_min: the max / min over both processes' tokens, as
    # in one process (a token-weighted mean of the two processes' maxima would differ)
    runs = _one_and_two_processes(tmp_path, ["algorithm=grpo", "num_iterations=2"])
    for a, b in zip(runs["one"], runs["two"]):
        assert a["ratio_max"] > 1 > a["ratio_min"]
        for key in ("ratio_max", "ratio_min", "ratio_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)


def _one_and_two_processes(tmp_path, settings):
    import json

    from torchforge.trainer.cli import main

    common = ["max_steps=2", "prompts_per_step=4", "num_generations=4", "kl_coef=0.05", "progress_bar=false",
              "distributed_strategy=ddp", "loss_aggregation=seq-mean-token-mean", "learning_rate=1e-2", *settings]
    runs = {}
    for name, nproc in (("one", []), ("two", ["--nproc", "2"])):
        assert main(["train", *nproc, *common, f"output_dir={tmp_path / name}"]) == 0
        runs[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in runs["two"]] == [1, 2]
    return runs


# --- the settings of the policy loss (RLConfig.policy_loss, kl_gradient) ---------------------

def _off_policy_batch(seed=0, B=8, T=6):
    from torchforge.batch import Batch

    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 2 - 0.1
    log_probs = (old + 0.3 * torch.randn(B, T, generator=g)).requires_grad_()
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[:, 0] = True
    return Batch(log_probs=log_probs, old_log_probs=old, ref_log_probs=old + 0.2 * torch.randn(B, T, generator=g),
                 advantages=torch.randn(B, generator=g), mask=mask, batch_size=[B])


def _loss_and_grad(algorithm, batch, method="compute_loss"):
    from torchforge.reduce import Aggregation

    torch.manual_seed(0)  # clip_cov draws its selection
    with algorithm.bind(batch, Aggregation("token-mean")):
        loss, metrics = getattr(algorithm, method)(batch)
    return loss, metrics, torch.autograd.grad(loss, batch.log_probs)[0]


def _expected_policy_loss(name, b, c):
    import torchforge as tf  # every loss, whichever module defines it

    args = (b.log_probs, b.old_log_probs, b.advantages, b.mask)
    clip = dict(clip_low=c.clip_low, clip_high=c.clip_high)
    torch.manual_seed(0)
    return {
        "ppo": lambda: tf.ppo_loss(*args, **clip),
        "gspo": lambda: tf.ppo_loss(*args, **clip, ratio_level="sequence"),
        "cispo": lambda: tf.cispo_loss(*args, **clip),
        "sapo": lambda: tf.sapo_loss(*args, tau_pos=c.sapo_tau_pos, tau_neg=c.sapo_tau_neg),
        "gmpo": lambda: tf.gmpo_loss(*args, **clip, aggregation="token-mean"),
        "clip_cov": lambda: tf.clip_cov_loss(*args, **clip, select_frac=c.cov_select_frac, cov_low=c.cov_low,
                                             cov_high=c.cov_high),
        "kl_cov": lambda: tf.kl_cov_loss(*args, select_frac=c.cov_select_frac, kl_coef=c.kl_cov_coef),
        "reinforce": lambda: tf.reinforce_loss(b.log_probs, b.advantages, b.mask),
    }[name]()


def test_policy_loss_selects_the_loss_with_the_config_hyperparameters():
    # Algorithm.compute_loss -> policy_gradient_loss calls the loss named by policy_loss with
    # the config's hyperparameters; each setting gives a different loss value and gradient.
    from torchforge.trainer.config import POLICY_LOSSES, RLConfig

    values, grads = {}, {}
    for name in POLICY_LOSSES:
        algorithm = Algorithm()
        algorithm.config = RLConfig(policy_loss=name, clip_low=0.1, clip_high=0.15, sapo_tau_pos=0.9,
                                    cov_select_frac=0.2, kl_cov_coef=2.0, kl_coef=0.0)
        batch = _off_policy_batch()
        loss, metrics, grad = _loss_and_grad(algorithm, batch)
        expected, expected_metrics = _expected_policy_loss(name, batch, algorithm.config)
        assert torch.equal(loss, expected), name
        assert metrics.keys() == expected_metrics.keys(), name
        values[name], grads[name] = loss.item(), grad
    for i, a in enumerate(POLICY_LOSSES):
        for b in POLICY_LOSSES[i + 1:]:
            # clip_cov's value is ppo's (it detaches selected tokens): the gradient tells them apart
            assert values[a] != values[b] or not torch.allclose(grads[a], grads[b]), (a, b)
    assert values["clip_cov"] == values["ppo"] and not torch.allclose(grads["clip_cov"], grads["ppo"])


def test_grpo_with_another_policy_loss_adds_the_kl_penalty():
    # loss = cispo_loss + kl_coef * token-mean(k3); the kl metric is the masked mean of k3
    from torchforge.kl import approx_kl
    from torchforge.trust_region_losses import cispo_loss
    from torchforge.reduce import aggregate, masked_mean
    from torchforge.trainer.config import RLConfig

    grpo = GRPO()
    grpo.config = RLConfig(policy_loss="cispo", kl_coef=0.3, clip_low=0.1, clip_high=0.15)
    batch = _off_policy_batch()
    loss, metrics, _ = _loss_and_grad(grpo, batch)
    pg_loss, _ = cispo_loss(batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask,
                            clip_low=0.1, clip_high=0.15)
    kl = approx_kl(batch.log_probs, batch.ref_log_probs, estimator="k3")
    torch.testing.assert_close(loss, pg_loss + 0.3 * aggregate(kl, batch.mask), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(metrics["kl"], masked_mean(kl.detach(), batch.mask))
    assert set(cispo_loss(batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask, clip_low=0.1,
                          clip_high=0.15)[1]) | {"kl"} == set(metrics)  # cispo's metrics are kept


@pytest.mark.parametrize("policy_loss", ["ppo", "reinforce"])
def test_kl_gradient_changes_the_gradient_not_the_value(policy_loss):
    # GRPO (grpo_loss for "ppo", kl_penalty otherwise) passes kl_gradient to the estimator:
    # the same loss value, another gradient
    from torchforge.trainer.config import RLConfig

    out = {}
    for form in ("estimator", "straight-through"):
        grpo = GRPO()
        grpo.config = RLConfig(policy_loss=policy_loss, kl_coef=0.5, kl_gradient=form)
        out[form] = _loss_and_grad(grpo, _off_policy_batch())
    (v1, _, g1), (v2, _, g2) = out["estimator"], out["straight-through"]
    torch.testing.assert_close(v1, v2, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(g1, g2)


def test_ppo_and_grpo_use_policy_loss_in_training(tmp_path):
    seen = []

    class Spy(GRPO):
        def policy_gradient_loss(self, log_probs, advantages):
            seen.append(self.config.policy_loss)
            return super().policy_gradient_loss(log_probs, advantages)

    trainer = RLTrainer(algorithm=Spy(), config=small_config(tmp_path, max_steps=1, policy_loss="gspo", kl_coef=0.0))
    assert math.isfinite(trainer.train_step(0)["loss"]) and seen == []  # gspo: GRPO's own grpo_loss
    trainer = RLTrainer(algorithm=Spy(), config=small_config(tmp_path, max_steps=1, policy_loss="sapo", kl_coef=0.0))
    assert math.isfinite(trainer.train_step(0)["loss"]) and seen == ["sapo"]  # one micro-batch

    class PPOSpy(PPO):
        def policy_gradient_loss(self, log_probs, advantages):
            seen.append(("ppo", self.config.policy_loss))
            return super().policy_gradient_loss(log_probs, advantages)

    trainer = RLTrainer(algorithm=PPOSpy(), config=small_config(tmp_path, algorithm="ppo", max_steps=1,
                                                                policy_loss="cispo"))
    assert math.isfinite(trainer.train_step(0)["loss"]) and seen[-1] == ("ppo", "cispo")


def test_kl_penalty_ignores_nan_outside_the_mask():
    from torchforge.trainer.config import RLConfig

    grpo = GRPO()
    grpo.config = RLConfig(policy_loss="reinforce", kl_coef=0.5)
    batch = _off_policy_batch()
    batch.mask[0, -1] = False
    clean = _loss_and_grad(grpo, batch)
    batch.ref_log_probs = batch.ref_log_probs.clone()
    batch.ref_log_probs[0, -1] = float("nan")
    loss, metrics, grad = _loss_and_grad(grpo, batch)
    assert torch.equal(loss, clean[0]) and torch.equal(metrics["kl"], clean[1]["kl"]) and torch.equal(grad, clean[2])
