"""The tiny local Llama and its character tokenizer: the model the loop's doctests and tests run."""

import torch

from torchforge.loop.tiny_model import CHARACTERS, SPECIAL_TOKENS, char_tokenizer, tiny_llama

EOS = SPECIAL_TOKENS.index("<eos>")


def test_the_tokenizer_maps_each_character_to_one_token_and_back():
    tokenizer = char_tokenizer()
    assert len(tokenizer) == len(SPECIAL_TOKENS) + len(CHARACTERS)
    ids = tokenizer(CHARACTERS)["input_ids"]
    assert ids == list(range(len(SPECIAL_TOKENS), len(tokenizer)))
    assert tokenizer.decode(ids) == CHARACTERS
    assert tokenizer("4a")["input_ids"] == [8, SPECIAL_TOKENS.index("<unk>")]  # one token per character
    batch = tokenizer(["1=", "123="], padding=True)["input_ids"]
    assert batch[0][:2] == [tokenizer.pad_token_id] * 2  # left padding, for generate
    assert char_tokenizer(pad_token=False).pad_token is None


def test_tiny_llama_is_seeded_and_leaves_the_global_rng_alone():
    tokenizer = char_tokenizer()
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a, b, c = tiny_llama(tokenizer, seed=1), tiny_llama(tokenizer, seed=1), tiny_llama(tokenizer, seed=2)
    assert torch.equal(torch.get_rng_state(), state)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))
    config = a.config
    assert (config.vocab_size, config.eos_token_id, config.pad_token_id) == (len(tokenizer), EOS, 0)
    assert a.training and a.dtype == torch.float32
