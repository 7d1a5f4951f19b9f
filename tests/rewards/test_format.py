"""The think/answer format reward on hand-written well-formed and malformed completions."""

import pytest

from torchforge.errors import InvalidArgumentError
from torchforge.rewards import ThinkAnswerFormat


@pytest.mark.parametrize("completion, reward", [
    ("<think>2+2 is 4</think><answer>4</answer>", 1.0),
    ("  <think>\nmulti\nline\n</think>\n\n<answer>\n4\n</answer>\n", 1.0),
    ("<answer>4</answer>", 0.0),                                        # no think block
    ("<think>a</think>", 0.0),                                          # no answer block
    ("<think>a</think><answer>4", 0.0),                                 # answer never closed (truncated)
    ("<think>a</think>so<answer>4</answer>", 0.0),                      # text between the blocks
    ("<think>a</think><answer>4</answer> and more", 0.0),               # text after
    ("Sure! <think>a</think><answer>4</answer>", 0.0),                  # text before
    ("<answer>4</answer><think>a</think>", 0.0),                        # wrong order
    ("<think>a</think><answer>4</answer><answer>5</answer>", 0.0),      # two answers
    ("<think>a<think>b</think><answer>4</answer>", 0.0),                # nested think
    ("<think> </think><answer>4</answer>", 0.0),                        # empty think
    ("<think>a</think><answer> </answer>", 0.0),                        # empty answer
    ("", 0.0),
])
def test_think_answer_format(completion, reward):
    assert ThinkAnswerFormat().compute([completion], ["q"]) == [reward]


def test_think_opened_in_the_prompt_and_other_tags():
    fn = ThinkAnswerFormat(think_in_prompt=True)
    assert fn.compute(["a</think><answer>4</answer>", "<think>a</think><answer>4</answer>"], ["q<think>"] * 2) == [1.0, 0.0]
    fn = ThinkAnswerFormat(think_tag="reasoning", answer_tag="final")
    assert fn(prompts=["q"] * 2, completions=["<reasoning>a</reasoning><final>4</final>",
                                              "<think>a</think><answer>4</answer>"]) == [1.0, 0.0]


@pytest.mark.parametrize("kwargs, message", [
    ({"think_tag": "<think>"}, r"ThinkAnswerFormat: think_tag must be a tag name such as 'think', got '<think>'"),
    ({"answer_tag": ""}, "ThinkAnswerFormat: answer_tag must be a tag name"),
    ({"think_tag": "a", "answer_tag": "a"}, "ThinkAnswerFormat: think_tag and answer_tag are both 'a'"),
])
def test_bad_tags(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        ThinkAnswerFormat(**kwargs)
