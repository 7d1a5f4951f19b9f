"""RLTrainer, RLConfig and the algorithms on the tiny local Llama (CPU, a few steps each)."""


import pytest

from torchforge.trainer.config import RLConfig
from torchforge.errors import InvalidArgumentError


@pytest.mark.parametrize("values, message", [
    (dict(algorithm="dpo"), r"RLConfig: algorithm='dpo'; expected one of \['grpo', 'ppo', 'reinforce'\]"),
    (dict(learning_rate=0), r"RLConfig: learning_rate=0; expected a finite number in \(0, inf\)"),
    (dict(learning_rate=float("inf")), r"RLConfig: learning_rate=inf; expected a finite number in \(0, inf\)"),
    (dict(num_generations=1), r"algorithm='grpo' with num_generations=1; expected >= 2"),
    (dict(micro_batch_size=6), r"micro_batch_size=6 is not a multiple of num_generations=4"),
    (dict(algorithm="reinforce", num_iterations=2), r"REINFORCE is on-policy"),
    (dict(algorithm="reinforce", num_generations=1), r"reinforce_baseline='rloo' with num_generations=1"),
    (dict(loss_aggregation="mean"), r"loss_aggregation='mean'; expected one of"),
    (dict(dual_clip=1.0), r"RLConfig: dual_clip=1.0 \(the dual_clip of policy_loss='ppo'\); ppo_loss: dual_clip must be > 1"),
    (dict(top_p=1.5), r"top_p=1.5; expected a number in \(0, 1\]"),
    (dict(max_steps=0), r"max_steps=0; expected an int >= 1 or None"),
    (dict(mixed_precision="fp16"), r"mixed_precision='fp16'; expected one of \[None, 'no', 'fp32', 'bf16'\]"),
    (dict(distributed_strategy="zero3"), r"distributed_strategy='zero3'; expected one of \['fsdp', 'ddp', 'none'\]"),
    (dict(policy_loss="dpo"), r"policy_loss='dpo'; expected one of \['ppo', 'gspo', 'cispo', 'sapo', 'gmpo', 'clip_cov', 'kl_cov', 'reinforce'\]"),
    (dict(kl_gradient="exact"), r"kl_gradient='exact'; expected one of \['estimator', 'straight-through', 'bias-corrected'\]"),
    (dict(entropy_coef=-0.1), r"entropy_coef=-0.1; expected a finite number in \[0, inf\)"),
    (dict(mask_truncated_completions=1), r"mask_truncated_completions=1; expected True or False"),
    (dict(sapo_tau_neg=0), r"RLConfig: sapo_tau_neg=0 \(the tau_neg of policy_loss='sapo'\); sapo_loss: tau_neg must be > 0"),
    (dict(sapo_tau_pos=float("inf")), r"RLConfig: sapo_tau_pos=inf \(the tau_pos of policy_loss='sapo'\); sapo_loss: tau_pos must be finite and > 0"),
    (dict(kl_target=0.1, kl_horizon=5), r"kl_horizon=5 with 32 sequences per step could turn the adaptive KL "
                                         r"coefficient negative; expected kl_horizon >= 6.4"),
    (dict(cov_select_frac=0.0), r"RLConfig: cov_select_frac=0.0 \(the select_frac of policy_loss='clip_cov'\); clip_cov_loss: select_frac must be in \(0, 1\]"),
    (dict(cov_low=5.0, cov_high=1.0), r"RLConfig: cov_low=5.0 \(the cov_low of policy_loss='clip_cov'\); clip_cov_loss: cov_low must be < cov_high"),
    (dict(rollout_correction="icepop"), r"rollout_correction='icepop'; expected one of \['none', 'tis', 'mask'\]"),
    (dict(rollout_correction_level="seq"), r"rollout_correction_level='seq'; expected one of \['token', 'sequence', 'sequence-product'\]"),
    (dict(rollout_is_cap=0), r"rollout_is_cap=0; expected a number in \(0, inf\]"),
    (dict(rollout_mask_low=2.0), r"rollout_mask_low=2.0 and rollout_mask_high=2.0; expected rollout_mask_low < rollout_mask_high"),
    (dict(dynamic_sampling="yes"), r"dynamic_sampling='yes'; expected True or False"),
    (dict(max_sampling_rounds=0), r"max_sampling_rounds=0; expected an int >= 1"),
    (dict(top_entropy_quantile=0.0), r"top_entropy_quantile=0.0; expected a number in \(0, 1\]"),
    (dict(reward_aggregation="sum"), r"reward_aggregation='sum'; expected one of \['weighted_sum', 'normalize_then_sum'\]"),
    (dict(reward_clip="big"), r"reward_clip='big'; expected None, a number c > 0"),
    (dict(kl_target=0.0), r"kl_target=0.0; expected a number in \(0, inf\]"),
    (dict(kl_horizon=0), r"kl_horizon=0; expected a number in \(0, inf\]"),
    (dict(ref_model_sync_steps=0), r"ref_model_sync_steps=0; expected an int >= 1 or None"),
])
def test_invalid_configs_are_rejected_up_front(values, message):
    with pytest.raises(InvalidArgumentError, match=message):
        RLConfig(**values)


def test_config_from_dict_rejects_unknown_keys():
    with pytest.raises(InvalidArgumentError, match=r"RLConfig: unknown field\(s\) \['lr'\]"):
        RLConfig.from_dict({"lr": 1e-3})
    assert RLConfig.from_dict(RLConfig(kl_coef=0.0).to_dict()) == RLConfig(kl_coef=0.0)


def test_option_lists_are_those_of_distributed_config():
    from torchforge.distributed.parallelize import MIXED_PRECISIONS, STRATEGIES

    for strategy in STRATEGIES:
        assert RLConfig(distributed_strategy=strategy).distributed_strategy == strategy
    for precision in MIXED_PRECISIONS:
        assert RLConfig(mixed_precision=precision).mixed_precision == precision
