"""The tiny local Llama and its character tokenizer, shared by the loop tests."""

import pytest

from torchforge.trainer.demo import char_tokenizer, tiny_llama


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(tokenizer, seed=3)
