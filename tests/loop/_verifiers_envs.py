"""Small verifiers environments for tests/loop/test_verifiers.py (a module, so `load_environment` finds it).

AskThenCopy: the prompt is the digits followed by "="; turn 1 asks (its text starts with "="),
the environment answers with the digits and "=", turn 2 copies them. The rubric:
``copied`` (weight 0.8: the digits of the last turn in place), ``asked`` (weight 0.2) and
verifiers' own ``num_turns`` metric (weight 0). ``mode="raise"`` makes env_response fail on
rows whose answer starts with "1", ``mode="hang"`` makes it sleep 30 s there; ``mode="final"`` ends
the episode with a final environment response when turn 1 does not ask; ``mode="group"`` adds a group reward
function (``longest``: 1 for the episodes of a row whose last turn is the longest).
"""

import asyncio

import verifiers as vf
from datasets import Dataset


def _turns(completion):
    return [m["content"] if isinstance(m, dict) else m.content for m in completion
            if (m["role"] if isinstance(m, dict) else m.role) == "assistant"]


def copied(completion, answer, **kwargs) -> float:
    last = _turns(completion)[-1] if _turns(completion) else ""
    return sum(a == b for a, b in zip(last, answer)) / len(answer)


def asked(completion, **kwargs) -> float:
    turns = _turns(completion)
    return float(bool(turns) and turns[0].startswith("="))


def longest(completions, **kwargs) -> list[float]:
    lengths = [len((_turns(c) or [""])[-1]) for c in completions]
    return [float(n == max(lengths)) for n in lengths]


class AskThenCopy(vf.MultiTurnEnv):
    def __init__(self, mode="play", **kwargs):
        super().__init__(**kwargs)
        self.mode = mode

    async def env_response(self, messages, state, **kwargs):
        if self.mode == "raise" and state["answer"].startswith("1"):
            raise ValueError("the environment is broken on this row")
        if self.mode == "hang" and state["answer"].startswith("1"):
            await asyncio.sleep(30.0)
        if self.mode == "final" and not _turns(messages)[-1].startswith("="):
            state["final_env_response"] = [vf.UserMessage(content="0")]
            return state["final_env_response"]
        return [vf.UserMessage(content=state["answer"] + "=")]


def rows(n=8, seed=0):
    import random

    rng = random.Random(seed)
    digits = ["".join(rng.choice("0123456789") for _ in range(3)) for _ in range(n)]
    return Dataset.from_list([{"question": d + "=", "answer": d} for d in digits])


def load_environment(mode: str = "play", n: int = 8, max_turns: int = 2) -> vf.Environment:
    funcs, weights = [copied, asked], [0.8, 0.2]
    if mode == "group":
        funcs, weights = funcs + [longest], weights + [0.5]
    return AskThenCopy(mode=mode, dataset=rows(n), rubric=vf.Rubric(funcs=funcs, weights=weights), max_turns=max_turns)
