"""The loop's functions on the tiny local Llama: masks, rollout, log-probs, exact accumulation."""

import pytest
import torch

from torchforge.trainer.demo import tiny_llama
from torchforge.loop import (
    ValueModel,
    policy_log_probs,
    rollout,
)

EOS = 2


# --- masks from crafted generations --------------------------------------------------------

def _naive_log_probs(model, batch, temperature):
    """Full logits, log_softmax, gather: the obviously correct formulation."""
    ids = torch.cat([batch.prompt_tokens, batch.tokens], 1)
    attention = torch.cat([batch.prompt_mask, torch.ones_like(batch.tokens, dtype=torch.bool)], 1)
    positions = (attention.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention.long(), position_ids=positions).logits
    logits = logits[:, batch.prompt_tokens.shape[1] - 1:-1].float() / temperature
    log_p = logits.log_softmax(-1)
    return log_p.gather(-1, batch.tokens[..., None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_policy_log_probs_equal_full_logits_values_and_gradients(tokenizer, temperature):
    model = tiny_llama(tokenizer, seed=5)
    batch = rollout(model, tokenizer, ["123=", "9="], num_generations=2, max_new_tokens=5, seed=3,
                    temperature=temperature)
    weights = torch.randn(batch.tokens.shape, generator=torch.Generator().manual_seed(0))

    log_probs, entropy = policy_log_probs(model, batch, temperature=temperature, return_entropy=True)
    (log_probs * weights).sum().backward()
    fused_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    naive, naive_entropy = _naive_log_probs(model, batch, temperature)
    (naive * weights).sum().backward()

    torch.testing.assert_close(log_probs, naive, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, naive_entropy.detach(), atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(fused_grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)
    # the sampler's log-probs are those of the same distribution
    torch.testing.assert_close(batch.rollout_log_probs, log_probs.detach() * batch.mask, atol=1e-5, rtol=1e-5)


def test_value_model_starts_at_zero_and_has_one_value_per_token(tokenizer, model):
    batch = rollout(model, tokenizer, ["12="], num_generations=2, max_new_tokens=4, seed=0)
    critic = ValueModel(model)
    values = critic(batch)
    assert values.shape == batch.tokens.shape and values.dtype == torch.float32
    assert torch.equal(values, torch.zeros_like(values))
    assert critic._no_split_modules == ["LlamaDecoderLayer"]
    # its decoder is a copy, not the policy's
    assert critic.decoder is not model.get_decoder()


# --- the update ----------------------------------------------------------------------------


# --- the canary in the trainer's metrics ----------------------------------------------------

def test_the_trainer_logs_the_rollout_log_prob_gap_near_zero(tmp_path):
    # sampling and training share weights and dtype: the sampler's log-probs are the first
    # pass's, to float32 noise, and metrics.jsonl says so
    from torchforge.trainer.demo import demo_config
    from torchforge.trainer.tracking import read_metrics
    from torchforge.trainer.trainer import RLTrainer

    config = demo_config(max_steps=1, num_generations=4, prompts_per_step=2, max_completion_length=4,
                         progress_bar=False, output_dir=str(tmp_path / "run"))
    RLTrainer(config=config).train()
    (row,) = read_metrics(tmp_path / "run")
    assert 0.0 <= row["rollout/log_prob_gap"] < 1e-5
    assert abs(row["rollout/kl"]) < 1e-6
