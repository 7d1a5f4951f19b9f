"""The loop's functions on the tiny local Llama: masks, rollout, log-probs, exact accumulation."""

import pytest
import torch

from torchforge.trainer.demo import char_tokenizer
from torchforge.errors import InvalidArgumentError
from torchforge.loop import (
    completion_mask,
    completion_stop_ids,
    decode_completions,
    rollout,
)

EOS = 2


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
