"""The loop's functions on the tiny local Llama: masks, rollout, log-probs, exact accumulation."""

import pytest
import torch

from torchforge.batch import Batch
from torchforge.demo import char_tokenizer, tiny_llama
from torchforge.errors import InvalidArgumentError
from torchforge.loop import (
    ValueModel,
    completion_mask,
    accumulate_gradients,
    completion_stop_ids,
    decode_completions,
    micro_batches,
    optimizer_step,
    policy_log_probs,
    rollout,
)
from torchforge.reduce import aggregate

EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(tokenizer, seed=3)


# --- masks from crafted generations --------------------------------------------------------

def test_mask_when_pad_equals_eos():
    # generate pads finished rows with pad == eos: the first eos counts, the padding does not
    tokens = torch.tensor([[5, EOS, EOS, EOS], [EOS, EOS, EOS, EOS], [5, 6, 7, EOS]])
    mask, truncated = completion_mask(tokens, [EOS])
    assert mask.tolist() == [[True, True, False, False], [True, False, False, False], [True, True, True, True]]
    assert truncated.tolist() == [False, False, False]


def test_mask_with_several_stop_ids_and_truncation():
    tokens = torch.tensor([[5, 9, 3, 0], [5, 6, 7, 8], [9, 5, 5, 5]])
    mask, truncated = completion_mask(tokens, [3, 9])
    assert mask.tolist() == [[True, True, False, False], [True, True, True, True], [True, False, False, False]]
    assert truncated.tolist() == [False, True, False]


def test_stop_ids_come_from_tokenizer_model_and_extra(tokenizer, model):
    model.generation_config.eos_token_id = [EOS, 13]
    try:
        assert completion_stop_ids(tokenizer, model, [14]) == [EOS, 13, 14]
    finally:
        model.generation_config.eos_token_id = EOS


# --- rollout -------------------------------------------------------------------------------

def _check_rollout_invariants(batch, stop_ids, max_new_tokens):
    tokens, mask = batch.tokens, batch.mask
    assert tokens.shape[1] <= max_new_tokens
    for row, m, trunc in zip(tokens, mask, batch.truncated):
        stops = [t for t, tok in enumerate(row.tolist()) if tok in stop_ids]
        expected = stops[0] + 1 if stops else len(row)
        assert m.sum().item() == expected and m[:expected].all()
        assert bool(trunc) == (not stops)


def test_rollout_layout_and_masks(tokenizer, model):
    batch = rollout(model, tokenizer, ["123=", "9="], num_generations=3, max_new_tokens=6, seed=0)
    assert batch.batch_size == torch.Size([6])
    # prompts left-padded, repeated G times contiguously
    assert batch.prompt_mask.tolist()[3] == [False, False, True, True]
    assert torch.equal(batch.prompt_tokens[0], batch.prompt_tokens[2])
    assert batch.prompt_tokens[3, :2].tolist() == [tokenizer.pad_token_id] * 2
    _check_rollout_invariants(batch, [EOS], 6)
    completions, ids = decode_completions(tokenizer, batch)
    assert len(completions) == 6 and all(len(i) == m.sum() for i, m in zip(ids, batch.mask))
    assert all("<eos>" not in c for c in completions)


def test_rollout_without_a_pad_token(model):
    tokenizer = char_tokenizer(pad_token=False)
    assert tokenizer.pad_token_id is None
    batch = rollout(model, tokenizer, ["123=", "4="], num_generations=2, max_new_tokens=8, seed=1)
    assert batch.prompt_tokens[2, :2].tolist() == [EOS, EOS]  # padded with eos, masked out
    _check_rollout_invariants(batch, [EOS], 8)


def test_rollout_several_stop_ids(tokenizer, model):
    stop = [EOS, 5, 6]  # eos, "1", "2"
    batch = rollout(model, tokenizer, ["123="], num_generations=8, max_new_tokens=8, seed=2, stop_token_ids=stop)
    _check_rollout_invariants(batch, stop, 8)


def test_samples_do_not_depend_on_the_batch_around_them(tokenizer, model):
    alone = rollout(model, tokenizer, ["45="], num_generations=4, max_new_tokens=6, seed=7, prompt_ids=[11])
    mixed = rollout(model, tokenizer, ["1234=", "45="], num_generations=4, max_new_tokens=6, seed=7,
                    prompt_ids=[10, 11])
    T = alone.tokens.shape[1]
    assert torch.equal(mixed.tokens[4:, :T], alone.tokens)
    assert torch.equal(mixed.mask[4:, :T], alone.mask)
    other_seed = rollout(model, tokenizer, ["45="], num_generations=4, max_new_tokens=6, seed=8, prompt_ids=[11])
    assert not torch.equal(other_seed.tokens, alone.tokens)


def test_rollout_follows_the_global_seed_when_no_seed_is_given(tokenizer, model):
    torch.manual_seed(0)
    a = rollout(model, tokenizer, ["12="], num_generations=4, max_new_tokens=5)
    torch.manual_seed(0)
    b = rollout(model, tokenizer, ["12="], num_generations=4, max_new_tokens=5)
    assert torch.equal(a.tokens, b.tokens)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_generations=0), r"rollout: num_generations must be an int >= 1, got 0"),
    (dict(max_new_tokens=0), r"rollout: max_new_tokens must be an int >= 1, got 0"),
    (dict(temperature=0.0), r"rollout: temperature must be > 0, got 0.0"),
    (dict(top_p=0.0), r"rollout: top_p must be in \(0, 1\], got 0.0"),
    (dict(top_k=-1), r"rollout: top_k must be an int >= 0, got -1"),
    (dict(prompt_ids=[1, 2]), r"rollout: 2 prompt_ids for 1 prompts"),
])
def test_rollout_errors(tokenizer, model, kwargs, message):
    args = dict(num_generations=2, max_new_tokens=3) | kwargs
    with pytest.raises(InvalidArgumentError, match=message):
        rollout(model, tokenizer, ["1="], **args)
    with pytest.raises(InvalidArgumentError, match="prompts is empty"):
        rollout(model, tokenizer, [], num_generations=2, max_new_tokens=3)


# --- log-probs -----------------------------------------------------------------------------

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

def _toy_parts(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(6, 5, generator=g) < 0.6
    mask[2] = False  # an empty row
    x = torch.randn(6, 5, generator=g)
    return Batch(tokens=torch.zeros(6, 5, dtype=torch.long), mask=mask, advantages=x, batch_size=[6])


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_accumulated_micro_batches_give_the_whole_batch_gradient(mode):
    weight = torch.nn.Parameter(torch.tensor(1.5))
    batch = _toy_parts()

    def loss_fn(part, aggregation):
        per_token = (weight * part.advantages) ** 2
        return aggregation(per_token, part.mask), {"m": per_token.detach().mean()}

    loss, _ = accumulate_gradients(list(micro_batches(batch, 2)), loss_fn, mode=mode, norm_length=5)
    accumulated = weight.grad.clone()
    weight.grad = None
    whole = aggregate((weight * batch.advantages) ** 2, batch.mask, mode=mode, norm_length=5)
    whole.backward()
    torch.testing.assert_close(accumulated, weight.grad, rtol=1e-6, atol=0)
    torch.testing.assert_close(loss, whole.detach(), rtol=1e-6, atol=0)


def test_optimizer_step_clips_and_reports_the_norm():
    weight = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    weight.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    norm = optimizer_step([weight], optimizer, max_grad_norm=1.0)
    assert norm == pytest.approx(5.0)
    torch.testing.assert_close(weight.detach(), torch.tensor([-0.6, -0.8, 0.0, 0.0]))
    assert weight.grad is None


def test_micro_batches_errors():
    with pytest.raises(InvalidArgumentError, match="micro_batches: size must be an int >= 1, got 0"):
        list(micro_batches(_toy_parts(), 0))
