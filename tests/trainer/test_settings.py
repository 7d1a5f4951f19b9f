"""The trainer settings of rollout corrections, reward aggregation / clipping, adaptive KL and the
reference refresh: each one changes what it says (a loss, a weight, an advantage, a coefficient)."""

import math

import pytest
import torch

from tests.trainer.test_trainer import _params, small_config
from torchforge.advantages import group_advantages
from torchforge.batch import Batch
from torchforge.errors import InvalidArgumentError, TorchforgeError
from torchforge.kl import adaptive_kl_coef
from torchforge.trainer.algorithms import GRPO, Algorithm
from torchforge.trainer.config import RLConfig
from torchforge.trainer.demo import CopyDigitsReward
from torchforge.trainer.trainer import RLTrainer

pytestmark = pytest.mark.filterwarnings("ignore:rollout_log_prob_gap:RuntimeWarning")  # the shifted sampler


class ShiftedSampler(RLTrainer):
    """The sampler reports log-probs lower by ``shift`` on the rows of ``rows``: a trainer /
    sampler ratio of exp(shift) there, as a numerically different inference engine would."""

    shift = math.log(2.0)
    rows = slice(None)

    def sample_step(self, step, sampling_round=0):
        scored = super().sample_step(step, sampling_round)
        shifted = scored.batch.rollout_log_probs.clone()
        shifted[self.rows] -= self.shift
        scored.batch.rollout_log_probs = shifted
        return scored


def _batch(old, rollout, mask):
    return Batch(old_log_probs=torch.log(torch.tensor(old)), rollout_log_probs=torch.log(torch.tensor(rollout)),
                 mask=torch.tensor(mask), batch_size=[len(old)])


# --- rollout_correction ----------------------------------------------------------------------

def test_correction_weights_hand_derived():
    # ratios old / rollout: 2, 1, 0.25 (third token masked out)
    batch = _batch([[0.5, 0.9, 0.2]], [[0.25, 0.9, 0.8]], [[True, True, False]])
    algorithm = Algorithm()
    algorithm.config = RLConfig(rollout_correction="tis", rollout_is_cap=1.5)
    weights, metrics = algorithm.correction_weights(batch)
    torch.testing.assert_close(weights, torch.tensor([[1.5, 1.0, 0.0]]))
    assert metrics["rollout/is_weight_mean"].item() == pytest.approx(1.25)
    assert metrics["rollout/masked_frac"].item() == 0.0
    algorithm.config = RLConfig(rollout_correction="mask", rollout_mask_low=0.5, rollout_mask_high=1.5)
    weights, metrics = algorithm.correction_weights(batch)  # IcePop: ratio 2 leaves [0.5, 1.5]
    torch.testing.assert_close(weights, torch.tensor([[0.0, 1.0, 0.0]]))
    assert metrics["rollout/masked_frac"].item() == 0.5
    algorithm.config = RLConfig(rollout_correction="mask", rollout_correction_level="sequence",
                                rollout_mask_low=0.5, rollout_mask_high=1.5)
    weights, _ = algorithm.correction_weights(batch)  # MIS: geometric mean sqrt(2) = 1.41 is kept
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.0, 0.0]]))
    algorithm.config = RLConfig()
    assert algorithm.correction_weights(batch) == (None, {})


def test_correction_without_rollout_log_probs_raises():
    algorithm = Algorithm()
    algorithm.config = RLConfig(rollout_correction="tis")
    batch = Batch(old_log_probs=torch.zeros(1, 2), mask=torch.ones(1, 2, dtype=torch.bool), batch_size=[1])
    with pytest.raises(TorchforgeError, match=r"Algorithm.correction_weights: rollout_correction='tis' but the "
                                              r"batch has no rollout_log_probs"):
        algorithm.correction_weights(batch)


@pytest.mark.parametrize("algorithm, extra", [
    ("grpo", {}),
    ("grpo", dict(policy_loss="cispo")),
    ("reinforce", {}),
])
def test_tis_weights_of_two_double_the_on_policy_loss(tmp_path, algorithm, extra):
    # every token's ratio is 2 (< cap 3): on the first pass the loss is -w A, token-mean: twice
    # the uncorrected loss, and the logged mean IS weight is 2
    runs = {}
    for correction in ("none", "tis"):
        config = small_config(tmp_path / correction, max_steps=1, kl_coef=0.0, algorithm=algorithm,
                              rollout_correction=correction, rollout_is_cap=3.0, **extra)
        runs[correction] = ShiftedSampler(config=config).train_step(0)
    assert runs["none"]["loss"] != 0
    assert runs["tis"]["loss"] == pytest.approx(2 * runs["none"]["loss"], rel=1e-4)
    assert runs["tis"]["rollout/is_weight_mean"] == pytest.approx(2.0, rel=1e-4)
    assert runs["tis"]["rollout/masked_frac"] == 0.0
    assert "rollout/is_weight_mean" not in runs["none"]
    assert runs["tis"]["rollout/kl"] == pytest.approx(runs["none"]["rollout/kl"])  # the canary, logged once


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mask_drops_the_mismatched_rows_and_keeps_the_denominator(tmp_path, level):
    # rows 0..7 sampled with a ratio of 4 (> high 2): weight 0 there; the loss is the uncorrected
    # per-token sum of the other rows over every counted token
    seen = {}

    class Spy(GRPO):
        def compute_loss(self, batch):
            seen["weights"], seen["batch"] = self.weights, batch
            return super().compute_loss(batch)

    trainer = ShiftedSampler(algorithm=Spy(), config=small_config(
        tmp_path, max_steps=1, kl_coef=0.0, rollout_correction="mask", rollout_correction_level=level,
        rollout_mask_low=0.5, rollout_mask_high=2.0))
    trainer.shift, trainer.rows = math.log(4.0), slice(0, 8)
    metrics = trainer.train_step(0)
    batch, weights = seen["batch"], seen["weights"]
    mask = batch.mask
    assert (weights[:8] == 0).all() and torch.equal(weights[8:], mask[8:].float())
    assert metrics["rollout/masked_frac"] == pytest.approx(mask[:8].sum().item() / mask.sum().item())
    per_token = -batch.advantages[:, None].expand_as(mask)  # on-policy: ratio 1
    expected = (per_token * weights)[mask].sum() / mask.sum()
    assert metrics["loss"] == pytest.approx(expected.item(), abs=1e-6)


def test_rollout_correction_needs_a_weighted_policy_loss():
    with pytest.raises(InvalidArgumentError, match=r"rollout_correction='tis' with policy_loss='clip_cov'; expected a "
                                                   r"policy loss that takes per-token weights"):
        RLConfig(rollout_correction="tis", policy_loss="clip_cov")


def test_gmpo_takes_the_rollout_correction_weights():
    # gmpo_loss takes weights= (as ppo_loss): RLConfig accepts a correction with it, and the
    # registry passes the weights through, where they scale each token's share of its row
    from torchforge.trainer.policy_losses import POLICY_LOSS_REGISTRY
    from torchforge.trust_region_losses import gmpo_loss

    config = RLConfig(rollout_correction="tis", policy_loss="gmpo")
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 5, generator=g)
    lp, adv, mask = old + 0.1 * torch.randn(4, 5, generator=g), torch.randn(4, generator=g), torch.ones(4, 5).bool()
    weights = torch.rand(4, 5, generator=g)
    loss, _ = POLICY_LOSS_REGISTRY["gmpo"](config, lp, old, adv, mask, weights=weights)
    kwargs = dict(clip_low=config.clip_low, clip_high=config.clip_high, aggregation="token-mean")
    assert torch.equal(loss, gmpo_loss(lp, old, adv, mask, weights, **kwargs)[0])
    assert not torch.allclose(loss, gmpo_loss(lp, old, adv, mask, **kwargs)[0])


# --- top_entropy_quantile --------------------------------------------------------------------

def test_top_entropy_quantile_keeps_the_top_tokens_of_the_whole_step(tmp_path):
    # one threshold for the step (4 micro-batches): ~20% of the step's counted tokens are kept,
    # the loss is the on-policy -A summed over the kept tokens over every counted token
    seen = []

    class Spy(GRPO):
        def compute_loss(self, batch):
            seen.append((self.weights, batch.mask, batch.advantages, self.entropy_threshold))
            return super().compute_loss(batch)

    trainer = RLTrainer(algorithm=Spy(), config=small_config(
        tmp_path, max_steps=1, kl_coef=0.0, top_entropy_quantile=0.2, micro_batch_size=4))
    metrics = trainer.train_step(0)
    assert len(seen) == 4 and len({float(t) for *_, t in seen}) == 1
    weights, mask, advantages = (torch.cat([part[i] for part in seen]) for i in range(3))
    n = int(mask.sum())
    kept = int(weights[mask].sum())
    assert set(weights.unique().tolist()) <= {0.0, 1.0} and not weights[~mask].any()
    # ties at the threshold are kept: the G samples of a prompt share their first token's entropy
    assert 0.2 * n - 1 <= kept <= 0.2 * n + 4
    assert metrics["frac_high_entropy"] == pytest.approx(kept / n, abs=1e-6)
    assert metrics["entropy_threshold"] == pytest.approx(float(seen[0][3]))
    expected = (-advantages[:, None] * weights)[mask].sum() / n
    assert metrics["loss"] == pytest.approx(expected.item(), abs=1e-6)


def test_top_entropy_quantile_needs_a_weighted_policy_loss():
    with pytest.raises(InvalidArgumentError, match=r"top_entropy_quantile=0.2 with policy_loss='kl_cov'"):
        RLConfig(top_entropy_quantile=0.2, policy_loss="kl_cov")


# --- reward_aggregation, reward_clip ---------------------------------------------------------

def _length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


class PrepareSpy(GRPO):
    def __init__(self):
        self.seen = []

    def prepare(self, batch):
        super().prepare(batch)
        self.seen.append(batch.clone())


def test_normalize_then_sum_gives_gdpo_advantages(tmp_path):
    runs = {}
    for aggregation in ("weighted_sum", "normalize_then_sum"):
        spy = PrepareSpy()
        config = small_config(tmp_path / aggregation, max_steps=1, kl_coef=0.0, reward_aggregation=aggregation,
                              reward_weights=[1.0, 0.5], learning_rate=1e-6)
        metrics = RLTrainer(algorithm=spy, config=config, reward_functions=[CopyDigitsReward(), _length_reward]
                            ).train_step(0)
        runs[aggregation] = (spy.seen[0], metrics)
    summed, metrics_sum = runs["weighted_sum"]
    gdpo, metrics_gdpo = runs["normalize_then_sum"]
    assert gdpo.rewards.shape == (16, 2)
    torch.testing.assert_close(gdpo.rewards[:, 0] + 0.5 * gdpo.rewards[:, 1], summed.rewards)
    torch.testing.assert_close(gdpo.advantages, group_advantages(gdpo.rewards, group_size=4,
                                                                 reward_weights=[1.0, 0.5]))
    assert not torch.allclose(gdpo.advantages, summed.advantages)
    assert metrics_gdpo["reward"] == metrics_sum["reward"]  # the logged reward: the weighted sum


def test_reward_clip_clips_what_the_update_sees(tmp_path):
    spy = PrepareSpy()
    config = small_config(tmp_path, max_steps=1, kl_coef=0.0, reward_clip=[0.0, 1.5])
    metrics = RLTrainer(algorithm=spy, config=config, reward_functions=[_length_reward]).train_step(0)
    rewards = spy.seen[0].rewards
    assert rewards.max() == 1.5 and metrics["reward"] > 1.5  # lengths up to 4; the log is as scored
    torch.testing.assert_close(spy.seen[0].advantages, group_advantages(rewards, group_size=4))


@pytest.mark.parametrize("values, message", [
    (dict(reward_clip=0), r"reward_clip=0; expected None, a number c > 0"),
    (dict(reward_clip=[1, 0]), r"reward_clip=\[1, 0\]; expected None, a number c > 0 .* low < high"),
    (dict(reward_aggregation="normalize_then_sum", algorithm="ppo"),
     r"reward_aggregation='normalize_then_sum' with algorithm='ppo'; expected algorithm='grpo'"),
])
def test_reward_settings_are_validated(values, message):
    with pytest.raises(InvalidArgumentError, match=message):
        RLConfig(**values)


def test_reward_clip_number_is_a_symmetric_window():
    assert RLConfig(reward_clip=2).reward_clip == [-2.0, 2.0]
    assert RLConfig(reward_clip=(-1, 3)).reward_clip == [-1.0, 3.0]


# --- adaptive KL -----------------------------------------------------------------------------

def test_adaptive_kl_moves_the_coefficient_and_resumes_exactly(tmp_path):
    config = dict(max_steps=3, kl_coef=0.05, kl_target=1e-6, kl_horizon=10.0)
    trainer = RLTrainer(config=small_config(tmp_path / "full", **config))
    history = [trainer.train_step(step) for step in range(3)]
    assert history[0]["kl_coef"] == 0.05
    # step 0: the policy is the reference (kl 0 < target): -20% * 16 / 10; then kl > target: +32%
    assert history[0]["kl"] == 0 and history[1]["kl"] > 1e-6
    assert history[1]["kl_coef"] == pytest.approx(0.05 * (1 - 0.32), rel=1e-12)
    assert history[2]["kl_coef"] == pytest.approx(history[1]["kl_coef"] * 1.32, rel=1e-12)
    for before, after in zip(history, history[1:]):
        expected = adaptive_kl_coef(before["kl_coef"], before["kl"], target=1e-6, horizon=10.0, num_steps=16)
        assert after["kl_coef"] == pytest.approx(expected, rel=1e-12)

    RLTrainer(config=small_config(tmp_path / "resumed", save_steps=2, **{**config, "max_steps": 2})).train()
    seen = []

    class Spy(GRPO):
        def compute_loss(self, batch):
            seen.append((self.context.step, self.kl_coef))
            return super().compute_loss(batch)

    resumed = RLTrainer(config=small_config(tmp_path / "resumed", resume=True, **config), algorithm=Spy())
    assert resumed.resume() == 2
    assert resumed.kl_coef == pytest.approx(history[2]["kl_coef"], rel=1e-12)  # the trainer's coefficient
    resumed.train_step(2)  # the algorithm gets it in the step's context
    assert seen[0][0] == 2 and seen[0][1] == pytest.approx(history[2]["kl_coef"], rel=1e-12)


def test_kl_penalty_uses_the_current_coefficient():
    algorithm = Algorithm()
    algorithm.config = RLConfig(kl_coef=0.1, kl_estimator="k1")
    batch = Batch(log_probs=torch.tensor([[-1.0, -2.0]]), old_log_probs=torch.tensor([[-1.0, -2.0]]),
                  ref_log_probs=torch.tensor([[-1.5, -2.0]]), mask=torch.ones(1, 2, dtype=torch.bool), batch_size=[1])
    from torchforge.reduce import Aggregation

    aggregation = Aggregation("token-mean", num_tokens=2)
    with algorithm.bind(batch, aggregation):
        loss, _ = algorithm.kl_penalty(batch)  # k1 = 0.5, 0 -> mean 0.25
        algorithm.kl_coef = 0.4
        loss_after, _ = algorithm.kl_penalty(batch)
    assert loss.item() == pytest.approx(0.025) and loss_after.item() == pytest.approx(0.1)


def test_kl_settings_need_a_kl_term():
    with pytest.raises(InvalidArgumentError, match=r"kl_target=0.1 with kl_coef=0; expected kl_coef > 0"):
        RLConfig(kl_target=0.1, kl_coef=0.0)
    with pytest.raises(InvalidArgumentError, match=r"ref_model_sync_steps=2 with kl_coef=0"):
        RLConfig(ref_model_sync_steps=2, kl_coef=0.0)


# --- ref_model_sync_steps --------------------------------------------------------------------

def test_ref_model_sync_steps_refreshes_the_reference(tmp_path):
    refs = {}
    for every in (None, 2):
        trainer = RLTrainer(config=small_config(tmp_path / str(every), max_steps=2, ref_model_sync_steps=every))
        initial = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
        trainer.train_step(0)
        after_one = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
        trainer.train_step(1)
        policy = _params(trainer)
        refs[every] = (initial, after_one, {n: p.detach() for n, p in trainer.ref_model.named_parameters()}, policy)
    for every, (initial, after_one, after_two, policy) in refs.items():
        for name, value in initial.items():
            torch.testing.assert_close(after_one[name], value, rtol=0, atol=0)  # not yet refreshed
            if every is None:
                torch.testing.assert_close(after_two[name], value, rtol=0, atol=0)
            else:
                torch.testing.assert_close(after_two[name], policy[f"policy.{name}"], rtol=0, atol=0)
        assert any(not torch.equal(after_two[n], initial[n]) for n in initial) == (every is not None)


def test_ref_model_sync_steps_refuses_lora():
    with pytest.raises(InvalidArgumentError, match=r"ref_model_sync_steps=2 with lora; expected one of them"):
        RLConfig(ref_model_sync_steps=2, lora={"rank": 4})


# --- the command line: validated by RLConfig before any model loads --------------------------

def test_command_line_settings_are_checked_before_the_model_loads():
    from torchforge.trainer.cli import check_run

    run = check_run({"reward_clip": [-1, 2], "rollout_correction": "mask", "rollout_correction_level": "sequence",
                     "kl_coef": 0.1, "kl_target": 0.05, "ref_model_sync_steps": 4,
                     "reward_aggregation": "normalize_then_sum"})
    assert (run.config.reward_clip, run.config.rollout_correction, run.config.kl_target) == ([-1.0, 2.0], "mask", 0.05)
    with pytest.raises(InvalidArgumentError, match=r"rollout_correction='icepop'; expected one of"):
        check_run({"rollout_correction": "icepop"})
    with pytest.raises(InvalidArgumentError, match=r"kl_target=0.1 with kl_coef=0"):
        check_run({"kl_target": 0.1})  # the demo's kl_coef is 0


# --- dynamic_sampling ------------------------------------------------------------------------

def _half_constant(prompts, completions, **kwargs):
    """The completion's length for a prompt starting with 0, 3, 6 or 9; otherwise 1 for every
    completion (a group of equal rewards)."""
    return [float(len(c)) if int(p[0]) % 3 == 0 else 1.0 for p, c in zip(prompts, completions)]


@pytest.mark.parametrize("rounds", [1, 6])
def test_dynamic_sampling_replaces_groups_of_equal_rewards(tmp_path, rounds):
    runs = {}
    for flag in (False, True):
        spy = PrepareSpy()
        config = small_config(tmp_path / str(flag), max_steps=1, kl_coef=0.0, dynamic_sampling=flag,
                              max_sampling_rounds=rounds)
        metrics = RLTrainer(algorithm=spy, config=config, reward_functions=[_half_constant]).train_step(0)
        groups = spy.seen[0].rewards.view(-1, 4)
        runs[flag] = (metrics, groups, int((groups.max(1).values == groups.min(1).values).sum()))
    (_, plain, plain_equal), (metrics, groups, equal) = runs[False], runs[True]
    assert plain_equal > 0 and groups.shape == plain.shape == (4, 4)  # the batch stays full
    assert metrics["dynamic_sampling/rounds"] <= rounds
    assert metrics["dynamic_sampling/prompts_drawn"] == 4 * metrics["dynamic_sampling/rounds"]
    assert equal == metrics["dynamic_sampling/filled_groups"]
    if rounds == 1:  # nothing to draw from: the same groups, informative ones first
        assert equal == plain_equal
    else:
        assert metrics["dynamic_sampling/rounds"] > 1 and equal == 0
        assert metrics["frac_reward_zero_std"] == 0.0


def test_rounds_of_different_lengths_concatenate_padded():
    from torchforge.trainer.trainer import _cat_padded

    a = Batch(tokens=torch.tensor([[5, 6]]), mask=torch.tensor([[True, True]]), rollout_log_probs=torch.tensor([[-1.0, -2.0]]),
              prompt_tokens=torch.tensor([[1]]), prompt_mask=torch.tensor([[True]]), rewards=torch.tensor([1.0]),
              truncated=torch.tensor([False]), batch_size=[1])
    b = Batch(tokens=torch.tensor([[7]]), mask=torch.tensor([[True]]), rollout_log_probs=torch.tensor([[-3.0]]),
              prompt_tokens=torch.tensor([[2, 3]]), prompt_mask=torch.tensor([[True, True]]), rewards=torch.tensor([0.0]),
              truncated=torch.tensor([True]), batch_size=[1])
    both = _cat_padded([a, b], pad_id=9)
    assert both.tokens.tolist() == [[5, 6], [7, 9]] and both.mask.tolist() == [[True, True], [True, False]]
    assert both.rollout_log_probs.tolist() == [[-1.0, -2.0], [-3.0, 0.0]]
    assert both.prompt_tokens.tolist() == [[9, 1], [2, 3]] and both.prompt_mask.tolist() == [[False, True], [True, True]]
    assert both.rewards.tolist() == [1.0, 0.0] and both.truncated.tolist() == [False, True]


# --- two processes ---------------------------------------------------------------------------

def test_adaptive_kl_top_entropy_and_tis_on_two_processes_equal_one(tmp_path):
    # the entropy threshold gathers every process's tokens and the KL coefficient follows the
    # global kl: two processes log what one does
    from tests.trainer.test_algorithms import _one_and_two_processes

    runs = _one_and_two_processes(tmp_path, ["kl_target=0.001", "kl_horizon=100", "top_entropy_quantile=0.5",
                                             "rollout_correction=tis"])
    for a, b in zip(runs["one"], runs["two"]):
        for key in ("loss", "kl_coef", "entropy_threshold", "frac_high_entropy", "rollout/is_weight_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
    assert runs["one"][1]["kl_coef"] != runs["one"][0]["kl_coef"]


def test_dynamic_sampling_rounds_are_decided_over_every_process(tmp_path, monkeypatch):
    # this process is full after its first round, but another process (simulated: the sum over
    # ranks adds its shortage of 1 group) is not: this one draws the same rounds, up to the limit
    import torchforge.trainer.trainer as trainer_module

    def with_a_short_process(x):
        return x + 1.0

    monkeypatch.setattr(trainer_module, "sum_over_ranks", with_a_short_process)
    config = small_config(tmp_path, max_steps=1, kl_coef=0.0, dynamic_sampling=True, max_sampling_rounds=3)
    metrics = RLTrainer(config=config, reward_functions=[_length_reward]).train_step(0)
    assert metrics["dynamic_sampling/rounds"] == 3 and metrics["dynamic_sampling/prompts_drawn"] == 12
    monkeypatch.undo()
    metrics = RLTrainer(config=small_config(tmp_path / "alone", max_steps=1, kl_coef=0.0, dynamic_sampling=True,
                                            max_sampling_rounds=3), reward_functions=[_length_reward]).train_step(0)
    assert metrics["dynamic_sampling/rounds"] == 1 and metrics["frac_reward_zero_std"] == 0.0


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ref_model_sync_steps_on_two_processes_equals_one(tmp_path, strategy):
    # refreshed after every step: step 2 samples from the policy the reference now is, so its
    # (on-policy, one pass) kl is exactly 0 on one process and on two; without the refresh it
    # is > 0 (test_adaptive_kl_moves_the_coefficient_and_resumes_exactly)
    from tests.trainer.test_algorithms import _one_and_two_processes

    runs = _one_and_two_processes(tmp_path, ["ref_model_sync_steps=1", f"distributed_strategy={strategy}"])
    assert runs["one"][1]["kl"] == runs["two"][1]["kl"] == 0.0
    assert runs["two"][1]["loss"] == pytest.approx(runs["one"][1]["loss"], rel=1e-4, abs=1e-7)
