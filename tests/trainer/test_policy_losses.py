"""The registry of policy losses: what each RLConfig.policy_loss calls, checks, and how the docs list it."""

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchforge as tf
from torchforge.errors import InvalidArgumentError, TorchforgeError
from torchforge.trainer.config import POLICY_LOSSES, RLConfig
from torchforge.trainer.policy_losses import POLICY_LOSS_REGISTRY, policy_loss_table

README = Path(__file__).resolve().parents[2] / "README.md"


def _inputs(seed=0, B=4, T=6):
    g = torch.Generator().manual_seed(seed)
    log_probs = -torch.rand(B, T, generator=g) * 3
    old = log_probs + 0.3 * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.7
    return log_probs, old, torch.randn(B, generator=g), mask


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_an_entry_calls_its_loss_with_the_config_settings(name):
    entry = POLICY_LOSS_REGISTRY[name]
    config = RLConfig(policy_loss=name, clip_low=0.15, clip_high=0.3, sapo_tau_pos=0.7, sapo_tau_neg=1.3,
                      cov_select_frac=0.25, kl_cov_coef=2.0)
    log_probs, old, advantages, mask = _inputs()
    got, got_metrics = entry(config, log_probs, old, advantages, mask, aggregation="seq-mean-token-mean")
    kwargs = {kw: getattr(config, field) for kw, field in entry.settings.items()}
    args = (log_probs, old, advantages, mask) if entry.takes_old_log_probs else (log_probs, advantages, mask)
    expected, metrics = getattr(tf, entry.loss.__name__)(*args, **kwargs, **entry.fixed,
                                                         aggregation="seq-mean-token-mean")
    assert torch.equal(got, expected) and got_metrics.keys() == metrics.keys()
    # every setting is a keyword of its loss, and the config field exists
    parameters = inspect.signature(entry.loss).parameters
    assert all(kw in parameters and hasattr(config, field) for kw, field in entry.settings.items())


def test_gspo_is_ppo_of_sequence_ratios():
    entry = POLICY_LOSS_REGISTRY["gspo"]
    log_probs, old, advantages, mask = _inputs(1)
    got, _ = entry(RLConfig(), log_probs, old, advantages, mask)
    expected, _ = tf.ppo_loss(log_probs, old, advantages, mask, ratio_level="sequence", clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(got, expected)
    assert entry.call() == 'ppo_loss(ratio_level="sequence")'


def test_weights_only_where_the_loss_takes_them():
    log_probs, old, advantages, mask = _inputs(2)
    weights = torch.rand(log_probs.shape)
    ppo = POLICY_LOSS_REGISTRY["ppo"]
    assert ppo.takes_weights
    got, _ = ppo(RLConfig(), log_probs, old, advantages, mask, weights=weights)
    expected, _ = tf.ppo_loss(log_probs, old, advantages, mask, weights, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(got, expected)
    unweighted = [n for n, e in POLICY_LOSS_REGISTRY.items() if not e.takes_weights]
    for name in unweighted:
        with pytest.raises(TorchforgeError, match=rf"policy loss '{name}' \(\w+\) takes no per-token weights"):
            POLICY_LOSS_REGISTRY[name](RLConfig(), log_probs, old, advantages, mask, weights=weights)


def test_the_loss_checks_the_settings_and_the_error_names_the_field():
    message = r"RLConfig: sapo_tau_neg=-1.0 \(the tau_neg of policy_loss='sapo'\); sapo_loss: tau_neg must be > 0"
    with pytest.raises(InvalidArgumentError, match=message):
        RLConfig(policy_loss="sapo", sapo_tau_neg=-1.0)
    with pytest.raises(InvalidArgumentError, match=message):  # every loss's settings, whichever loss is chosen
        RLConfig(policy_loss="ppo", sapo_tau_neg=-1.0)
    with pytest.raises(InvalidArgumentError, match=r"RLConfig: cov_low=2.0 \(the cov_low of policy_loss='clip_cov'\); "
                                                   r"clip_cov_loss: cov_low must be < cov_high"):
        RLConfig(cov_low=2.0, cov_high=1.0)


def test_the_readme_table_is_the_registrys():
    assert policy_loss_table() in README.read_text()
    assert len(policy_loss_table().splitlines()) == 2 + len(POLICY_LOSSES)


def test_torchforge_train_help_lists_each_policy_loss():
    out = subprocess.run([sys.executable, "-m", "torchforge", "train", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for entry in POLICY_LOSS_REGISTRY.values():
        line = re.search(rf"^  {entry.name} +(.*)$", out, flags=re.MULTILINE)
        assert line and entry.summary in line.group(1) and entry.call() in line.group(1), entry.name
