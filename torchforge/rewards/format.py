"""Format reward: does the completion follow the ``<think>...</think><answer>...</answer>`` layout?"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from torchforge.errors import InvalidArgumentError
from torchforge.loop.rewards import RewardFunction

__all__ = ["ThinkAnswerFormat"]


class ThinkAnswerFormat(RewardFunction):
    """1.0 when the completion is one think block then one answer block, else 0.0 (DeepSeek-R1).

    ``r_b = 1[completion_b matches ^\\s*<think>(.+?)</think>\\s*<answer>(.+?)</answer>\\s*$]``
    with exactly one of each tag, both blocks non-empty, nothing before, between or after
    them but whitespace. With ``think_in_prompt=True`` the opening ``<think>`` is expected
    in the prompt (templates that end with it), so the completion starts inside the think block.

    Args:
        think_tag: the reasoning tag name.
        answer_tag: the answer tag name.
        think_in_prompt: the prompt already opened the think block.

    Returns:
        A reward function: ``fn(prompts=..., completions=...) -> list[float]``.

    Example:
        >>> ThinkAnswerFormat().compute(["<think>2+2</think>\\n<answer>4</answer>", "<answer>4</answer>",
        ...                              "<think>a</think><answer>4</answer><answer>5</answer>"], ["q"] * 3)
        [1.0, 0.0, 0.0]

    References:
        DeepSeek-R1, section 2.2.2 "Reward Modeling", https://arxiv.org/abs/2501.12948
    """

    name = "think_answer_format"

    def __init__(self, *, think_tag: str = "think", answer_tag: str = "answer", think_in_prompt: bool = False) -> None:
        for arg, tag in (("think_tag", think_tag), ("answer_tag", answer_tag)):
            if not (isinstance(tag, str) and re.fullmatch(r"[A-Za-z_][\w-]*", tag)):
                raise InvalidArgumentError(f"ThinkAnswerFormat: {arg} must be a tag name such as 'think', got {tag!r}")
        if think_tag == answer_tag:
            raise InvalidArgumentError(f"ThinkAnswerFormat: think_tag and answer_tag are both {think_tag!r}; expected two tags")
        self.think_tag, self.answer_tag, self.think_in_prompt = think_tag, answer_tag, think_in_prompt
        open_think = "" if think_in_prompt else rf"<{think_tag}>"
        self._pattern = re.compile(
            rf"\s*{open_think}(?P<think>.+?)</{think_tag}>\s*<{answer_tag}>(?P<answer>.+?)</{answer_tag}>\s*", re.DOTALL)
        self._tags = [f"<{think_tag}>", f"</{think_tag}>", f"<{answer_tag}>", f"</{answer_tag}>"]

    def _ok(self, completion: str) -> bool:
        match = self._pattern.fullmatch(completion)
        if match is None or not match["think"].strip() or not match["answer"].strip():
            return False
        expected = [0 if self.think_in_prompt else 1, 1, 1, 1]
        return [completion.count(tag) for tag in self._tags] == expected

    def compute(self, completions: Sequence[str], prompts: Sequence[str]) -> list[float]:
        """Score each completion.

        Args:
            completions: B completions.
            prompts: B prompts (unused).

        Returns:
            B floats in {0.0, 1.0}.
        """
        return [float(self._ok(c)) for c in completions]

    def __call__(self, *, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float]:
        return self.compute(completions, prompts)
