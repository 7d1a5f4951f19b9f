"""Answer rewards: the final answer of a completion, compared exactly or symbolically.

A reasoning completion ends with its answer in ``\\boxed{...}`` (the MATH convention) or
between ``<answer>`` and ``</answer>`` (the DeepSeek-R1 convention). :func:`extract_answer`
finds it; :class:`ExactMatch` compares it with the reference as normalized text and
:class:`MathAccuracy` as mathematics, through ``math-verify`` (the optional extra
``torchforge[math]``).

Both read the reference answer from a dataset column (``answer`` by default), which
:func:`torchforge.loop.score_rewards` passes to every reward function.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

from torchforge.errors import InvalidArgumentError
from torchforge.loop.rewards import RewardFunction

__all__ = ["ExactMatch", "MathAccuracy", "extract_answer", "normalize_answer"]

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` whose braces balance; None when there is none."""
    found = None
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found = text[start:i]
                break
    return found


def extract_answer(completion: str) -> str | None:
    """The final answer of a completion: its last ``\\boxed{...}``, else its last ``<answer>`` block.

    A box whose braces never close and an ``<answer>`` tag never closed count as no answer
    (a truncated completion has not answered). Inside an ``<answer>`` block a box wins:
    ``<answer>so \\boxed{4}</answer>`` gives ``4``.

    Args:
        completion: the decoded completion.

    Returns:
        The answer text, stripped; None when the completion has no complete answer.

    Example:
        >>> extract_answer("2 + 2 = \\\\boxed{4}"), extract_answer("<think>...</think><answer> 4 </answer>")
        ('4', '4')
        >>> extract_answer("\\\\boxed{\\\\frac{1}{2}"), extract_answer("no answer")
        (None, None)
    """
    if not isinstance(completion, str):
        raise InvalidArgumentError(f"extract_answer: completion is a {type(completion).__name__}; expected a str")
    boxed = _last_boxed(completion)
    if boxed is not None:
        return boxed.strip()
    tagged = _ANSWER_TAG.findall(completion)
    return tagged[-1].strip() if tagged else None


_TEXT = re.compile(r"\\(?:text|textbf|mathrm)\{([^{}]*)\}")


def normalize_answer(text: str) -> str:
    """Normalize an answer for exact comparison.

    Lower case; ``\\text{x}`` -> ``x``; ``$`` signs and thousands separators in numbers
    (``1,000`` -> ``1000``) removed; runs of whitespace -> one space; surrounding spaces
    and one trailing period removed.

    Args:
        text: an answer.

    Returns:
        The normalized answer.

    Example:
        >>> normalize_answer("  The  Answer is \\\\text{Paris}. "), normalize_answer("$1,000$")
        ('the answer is paris', '1000')
    """
    text = _TEXT.sub(r"\1", text).replace("$", "")
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    text = " ".join(text.lower().split())
    return text[:-1].rstrip() if text.endswith(".") else text


def _references(fn: str, key: str, columns: dict[str, Any], n: int) -> Sequence[Any]:
    if key not in columns:
        raise InvalidArgumentError(
            f"{fn}: the dataset has no {key!r} column (columns: {sorted(columns)}); expected the reference "
            f"answers in {key!r}, or pass answer_key=<the column>"
        )
    references = columns[key]
    if len(references) != n:
        raise InvalidArgumentError(f"{fn}: {len(references)} {key!r} values for {n} completions; expected one each")
    return references


class ExactMatch(RewardFunction):
    """1.0 when the completion's answer equals the reference after normalization, else 0.0.

    ``r_b = 1[normalize_answer(answer(completion_b)) == normalize_answer(reference_b)]``, where
    ``answer`` is :func:`extract_answer` (``extract=True``; no complete answer gives 0.0)
    or the whole completion (``extract=False``). A reference of None gives None (not
    applicable to that row).

    Args:
        answer_key: the dataset column holding the reference answers.
        extract: compare the boxed / tagged answer (True) or the whole completion (False).
        normalize: apply :func:`normalize_answer` to both sides (False: compare stripped text).

    Returns:
        A reward function: ``fn(prompts=..., completions=..., answer=...) -> list[float | None]``.

    Example:
        >>> ExactMatch()(prompts=["q"] * 3, completions=["\\\\boxed{Paris.}", "<answer>paris</answer>", "Paris"],
        ...              answer=["Paris", "Paris", "Paris"])
        [1.0, 1.0, 0.0]
    """

    name = "exact_match"

    def __init__(self, *, answer_key: str = "answer", extract: bool = True, normalize: bool = True) -> None:
        self.answer_key, self.extract, self.normalize = answer_key, extract, normalize

    def score(self, completions: Sequence[str], references: Sequence[Any]) -> list[float | None]:
        """Score completions against their references (one each).

        Args:
            completions: B completions.
            references: B reference answers (None: not applicable).

        Returns:
            B floats in {0.0, 1.0}, or None where the reference is None.
        """
        clean = normalize_answer if self.normalize else str.strip
        out: list[float | None] = []
        for completion, reference in zip(completions, references, strict=True):
            if reference is None:
                out.append(None)
                continue
            answer = extract_answer(completion) if self.extract else completion
            out.append(float(answer is not None and clean(answer) == clean(str(reference))))
        return out

    def compute(self, completions, prompts):
        raise InvalidArgumentError(f"ExactMatch.compute: needs the {self.answer_key!r} column; call the "
                                   "object with keyword arguments, or use .score(completions, references)")

    def __call__(self, *, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float | None]:
        return self.score(completions, _references("ExactMatch", self.answer_key, columns, len(completions)))


class MathAccuracy(RewardFunction):
    """1.0 when the completion's final answer equals the reference mathematically, else 0.0.

    ``r_b = 1[verify(parse(reference_b), parse(answer(completion_b)))]`` with math-verify's
    ``parse`` and ``verify`` (symbolic: ``\\frac{1}{2}``, ``0.5`` and ``1/2`` are equal, and so
    are ``x+1`` and ``1+x``), where ``answer`` is :func:`extract_answer`. A completion with
    no complete boxed or tagged answer, or one that does not parse, gets 0.0; a reference
    that does not parse (or is None) gets None, so a bad dataset row is left out of the
    group statistics rather than punishing every completion.

    Args:
        answer_key: the dataset column holding the reference answers (TRL's GSM8K / MATH
            recipes call it ``solution``; a reference may be bare, ``$...$`` or boxed).
        timeout_seconds: math-verify's limit on each parse and comparison (it uses
            ``signal.alarm``, so only the main thread can time out; 0 disables it).

    Returns:
        A reward function: ``fn(prompts=..., completions=..., answer=...) -> list[float | None]``.

    Raises:
        ImportError: math-verify is not installed (``pip install 'torchforge[math]'``).

    Example:
        >>> MathAccuracy()(prompts=["q"] * 3, completions=["\\\\boxed{0.5}", "<answer>1/2</answer>", "\\\\boxed{2}"],
        ...                answer=["\\\\frac{1}{2}"] * 3)
        [1.0, 1.0, 0.0]

    References:
        math-verify, https://github.com/huggingface/Math-Verify

    Note:
        TRL's and open-r1's ``accuracy_reward`` parse the whole completion, so an answer
        mentioned in the reasoning can count; this reward reads only the final boxed or
        tagged answer, as the completion commits to it.
    """

    name = "math_accuracy"

    def __init__(self, *, answer_key: str = "answer", timeout_seconds: int = 5) -> None:
        try:
            import math_verify
        except ImportError as error:
            raise ImportError(
                "MathAccuracy needs math-verify, which is not installed; install the extra with "
                "`pip install 'torchforge[math]'` (or `pip install math-verify`)"
            ) from error
        if not (isinstance(timeout_seconds, int) and timeout_seconds >= 0):
            raise InvalidArgumentError(f"MathAccuracy: timeout_seconds must be an int >= 0, got {timeout_seconds!r}")
        self._mv = math_verify
        self.answer_key, self.timeout_seconds = answer_key, timeout_seconds

    def __getstate__(self) -> dict[str, Any]:  # picklable (worker processes): the module is imported again
        return {k: v for k, v in self.__dict__.items() if k != "_mv"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        import math_verify

        self.__dict__.update(state, _mv=math_verify)

    def _timeout(self) -> int | None:
        """math-verify's limit, in the main thread only: ``signal.alarm`` cannot be set from another
        (there ``GuardedReward``'s timeout is the limit)."""
        return self.timeout_seconds or None if threading.current_thread() is threading.main_thread() else None

    def _parse(self, text: str) -> list:
        mv, timeout = self._mv, self._timeout()
        configs = [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()]
        # bare text parses unreliably ("1+x" reads as 1): as math first, unless it is already delimited
        candidates = (text,) if "$" in text or "\\(" in text or "\\[" in text else (f"${text}$", text)
        for candidate in candidates:
            parsed = mv.parse(candidate, extraction_config=configs, fallback_mode="no_fallback",
                              parsing_timeout=timeout)
            if parsed:
                return parsed
        return []

    def score(self, completions: Sequence[str], references: Sequence[Any]) -> list[float | None]:
        """Score completions against their references (one each).

        Args:
            completions: B completions.
            references: B reference answers (None: not applicable).

        Returns:
            B floats in {0.0, 1.0}, or None where the reference is None or does not parse.
        """
        out: list[float | None] = []
        gold_cache: dict[str, list] = {}
        for completion, reference in zip(completions, references, strict=True):
            if reference is None:
                out.append(None)
                continue
            reference = str(reference)
            if reference not in gold_cache:
                boxed = extract_answer(reference)
                gold_cache[reference] = self._parse(boxed if boxed is not None else reference)
            gold = gold_cache[reference]
            if not gold:
                out.append(None)
                continue
            answer = extract_answer(completion)
            parsed = self._parse(answer) if answer else []
            ok = bool(parsed) and self._mv.verify(gold, parsed, timeout_seconds=self._timeout())
            out.append(float(ok))
        return out

    def compute(self, completions, prompts):
        raise InvalidArgumentError(f"MathAccuracy.compute: needs the {self.answer_key!r} column; call the "
                                   "object with keyword arguments, or use .score(completions, references)")

    def __call__(self, *, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float | None]:
        return self.score(completions, _references("MathAccuracy", self.answer_key, columns, len(completions)))
