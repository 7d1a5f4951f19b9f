"""Answer rewards: extraction, normalization, exact match and math-verify accuracy on hand-written cases."""

import sys

import pytest

from torchforge.errors import InvalidArgumentError
from torchforge.loop.rewards import RewardFunction, score_rewards
from torchforge.rewards import (
    ExactMatch,
    MathAccuracy,
    extract_answer,
    normalize_answer,
)


@pytest.mark.parametrize("completion, answer", [
    (r"so \boxed{4}", "4"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),            # nested braces
    (r"\boxed{3} no, wait: \boxed{ 5 }", "5"),             # the last box
    (r"\fbox{7}", "7"),
    ("<think>hm</think><answer> 12 </answer>", "12"),
    ("<answer>1</answer> then <answer>2</answer>", "2"),   # the last tag
    (r"<answer>so \boxed{9}</answer>", "9"),               # a box wins inside the tag
    (r"\boxed{4} and <answer>5</answer>", "4"),            # a box wins over a tag
    (r"\boxed{\frac{1}{2}", None),                         # never closed: truncated
    ("<answer>12", None),                                  # tag never closed
    ("12", None),
    ("", None),
    (r"\boxed{}", ""),
])
def test_extract_answer(completion, answer):
    assert extract_answer(completion) == answer


def test_extract_answer_rejects_non_strings():
    with pytest.raises(InvalidArgumentError, match="extract_answer: completion is a NoneType; expected a str"):
        extract_answer(None)


@pytest.mark.parametrize("text, normalized", [
    ("  Paris. ", "paris"),
    (r"\text{Paris}", "paris"),
    ("$1,000,000$", "1000000"),
    ("1,5", "1,5"),                 # not a thousands separator: kept
    ("New   York\n", "new york"),
    ("3.5", "3.5"),                 # a decimal point is not a trailing period
])
def test_normalize_answer(text, normalized):
    assert normalize_answer(text) == normalized


def test_exact_match_hand_cases():
    completions = [r"\boxed{Paris}", "<answer> paris. </answer>", "Paris", r"\boxed{Pari", "<answer>Lyon</answer>",
                   r"\boxed{1,000}", "anything"]
    answers = ["Paris", "Paris", "Paris", "Paris", "Paris", "1000", None]
    # unboxed / untagged and truncated answers count as wrong; a None reference is not applicable
    assert ExactMatch()(prompts=["q"] * 7, completions=completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, None]


def test_exact_match_options():
    assert ExactMatch(extract=False).score([" 42 ", "42.", "<answer>42</answer>"], ["42"] * 3) == [1.0, 1.0, 0.0]
    assert ExactMatch(normalize=False).score([r"\boxed{Paris}", r"\boxed{paris}"], ["Paris", "Paris"]) == [1.0, 0.0]
    fn = ExactMatch(answer_key="solution")
    assert fn(prompts=["q"], completions=[r"\boxed{x}"], solution=["x"]) == [1.0]


def test_exact_match_names_a_missing_column():
    with pytest.raises(InvalidArgumentError, match=r"ExactMatch: the dataset has no 'answer' column \(columns: \['label'\]\)"):
        ExactMatch()(prompts=["q"], completions=["a"], label=["a"])
    with pytest.raises(InvalidArgumentError, match=r"ExactMatch: 2 'answer' values for 1 completions"):
        ExactMatch()(prompts=["q"], completions=["a"], answer=["a", "b"])
    with pytest.raises(InvalidArgumentError, match="ExactMatch.compute: needs the 'answer' column"):
        ExactMatch().compute(["a"], ["q"])


@pytest.mark.parametrize("completion, reference, reward", [
    (r"\boxed{1/2}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac12}", "0.5", 1.0),
    ("<answer>x+1</answer>", "1+x", 1.0),                 # symbolic, not textual
    (r"<answer>$\frac{1}{2}$</answer>", "$0.5$", 1.0),
    (r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt2}{2}", 1.0),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),                # sets
    (r"\boxed{3}", r"\boxed{3}", 1.0),                    # a boxed reference
    ("<answer>1,000</answer>", "1000", 1.0),
    (r"\boxed{3} wait, no: \boxed{4}", "4", 1.0),          # the final answer counts
    (r"\boxed{3} wait, no: \boxed{4}", "3", 0.0),
    (r"\boxed{0.333}", "1/3", 0.0),
    (r"\boxed{2}", "3", 0.0),
    ("The answer is 3.", "3", 0.0),                        # not boxed or tagged
    (r"\boxed{3", "3", 0.0),                               # malformed: truncated box
    ("<answer></answer>", "3", 0.0),                       # empty answer
    ("<answer>abc</answer>", "3", 0.0),                    # not mathematics
    (r"\boxed{3}", "???", None),                           # a reference that does not parse
    (r"\boxed{3}", "", None),
    (r"\boxed{3}", None, None),
])
def test_math_accuracy_hand_cases(completion, reference, reward):
    assert MathAccuracy().score([completion], [reference]) == [reward]


def test_math_accuracy_through_score_rewards():
    total, parts = score_rewards([MathAccuracy(answer_key="solution"), ExactMatch(answer_key="solution")],
                                 prompts=["q"] * 3, completions=[r"\boxed{0.5}", r"\boxed{1/2}", "none"],
                                 columns={"solution": ["0.5", "0.5", "0.5"]})
    assert parts["math_accuracy"].tolist() == [1.0, 1.0, 0.0]
    assert parts["exact_match"].tolist() == [1.0, 0.0, 0.0]
    assert total.tolist() == [2.0, 1.0, 0.0]
    assert isinstance(MathAccuracy(), RewardFunction)


def test_math_accuracy_without_math_verify_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify -> ImportError
    with pytest.raises(ImportError, match=r"MathAccuracy needs math-verify.*pip install 'torchforge\[math\]'"):
        MathAccuracy()


def test_math_accuracy_bad_settings():
    with pytest.raises(InvalidArgumentError, match="MathAccuracy: timeout_seconds must be an int >= 0, got -1"):
        MathAccuracy(timeout_seconds=-1)
    with pytest.raises(InvalidArgumentError, match="MathAccuracy: the dataset has no 'answer' column"):
        MathAccuracy()(prompts=["q"], completions=["a"])
