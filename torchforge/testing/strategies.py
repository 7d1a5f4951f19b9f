"""Hypothesis strategies that draw inputs in the torchforge key vocabulary (see the package docstring)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from tensordict import TensorDict

from torchforge.errors import InvalidArgumentError, check_choice

try:  # a dev dependency: needed to call the functions here, not to import the module
    import hypothesis
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - exercised only without the dev extra
    hypothesis = st = None

__all__ = ["masks", "batches", "group_rewards", "policy_pairs"]

ADVANTAGE_LEVELS = ("sequence", "token", "any")
SHIFT_INVARIANCES = ("group", "batch", None)

# Reward values of group_rewards: multiples of 1/64 in [-10, 10] are exact in float32, and
# so are their sums and their shifts by multiples of 1/4 up to 100; distinct values differ
# by >= 1/64, far from the float32 rounding that makes near-ties ill-conditioned.
_REWARD_STEP = 1 / 64
_SHIFT_STEP = 1 / 4
# Constants of all-equal groups, some not representable in binary (0.1, 1/3): a mean of G
# copies may then round away from the value, which a naive std turns into a huge advantage.
_TIE_VALUES = (0.0, 1.0, 0.1, 0.11, 0.03, -0.3, 1 / 3, 7.7)


def _tie_value(G: int) -> float:
    """One of ``_TIE_VALUES`` whose float32 mean over G copies rounds away from it, if one
    does (none does when the sum and the division are exact, e.g. G = 1 or 2); else 0.1."""
    for c in _TIE_VALUES[2:]:
        r = torch.full((1, G), c)
        if (r - r.mean(-1, keepdim=True)).abs().max() > 0:
            return c
    return 0.1


# --- helpers ----------------------------------------------------------------------------

def _require_hypothesis(fn: str) -> None:
    if hypothesis is None:
        raise ImportError(f"{fn} needs hypothesis, a development dependency: pip install 'torchforge[dev]'")


def _bounds(fn: str, name: str, value, minimum: int) -> tuple[int, int]:
    """``value`` (an int, or a ``(low, high)`` pair of ints) as an inclusive range."""
    if isinstance(value, int) and not isinstance(value, bool):
        low = high = value
    elif (
        isinstance(value, (tuple, list)) and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        low, high = value
    else:
        raise InvalidArgumentError(f"{fn}: {name} must be an int or a (low, high) pair of ints, got {value!r}")
    if not minimum <= low <= high:
        raise InvalidArgumentError(
            f"{fn}: {name} is {value!r}; expected {minimum} <= low <= high"
        )
    return low, high


def _check_max_examples(fn: str, max_examples) -> None:
    if isinstance(max_examples, bool) or not isinstance(max_examples, int) or max_examples < 1:
        raise InvalidArgumentError(f"{fn}: max_examples must be an int >= 1, got {max_examples!r}")


def _fmt(x: torch.Tensor) -> str:
    return repr(x.detach()) if isinstance(x, torch.Tensor) else repr(x)


class _Shown:
    """``name = tensor(...)`` lines of a counterexample, formatted only when printed
    (formatting tensors costs more than most properties)."""

    def __init__(self, tensors: dict, suffix: str = ""):
        self.tensors, self.suffix = tensors, suffix

    def __add__(self, suffix: str) -> "_Shown":
        return _Shown(self.tensors, self.suffix + suffix)

    def __str__(self) -> str:
        return "\n".join(f"  {name} = {_fmt(value)}" for name, value in self.tensors.items()) + self.suffix

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def _show(**tensors) -> _Shown:
    return _Shown(tensors)


def _run(fn: str, prop, strategies: dict, max_examples: int, explicit: Sequence[dict] = ()) -> None:
    """Run ``prop`` under ``given(**strategies)``, after the ``explicit`` examples."""
    _require_hypothesis(fn)
    _check_max_examples(fn, max_examples)
    test = prop
    for kwargs in reversed(explicit):  # run in the order given
        test = hypothesis.example(**kwargs)(test)
    test = hypothesis.given(**strategies)(test)
    test = hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=False,
        report_multiple_bugs=False,
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate, hypothesis.Phase.shrink],
        suppress_health_check=[
            hypothesis.HealthCheck.too_slow,
            hypothesis.HealthCheck.data_too_large,
            hypothesis.HealthCheck.filter_too_much,
            hypothesis.HealthCheck.large_base_example,
        ],
    )(test)
    test()


def _grad(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d loss / d x, zeros where ``loss`` does not depend on ``x`` (a constant loss)."""
    if not loss.requires_grad:
        return torch.zeros_like(x)
    (g,) = torch.autograd.grad(loss, x, allow_unused=True)
    return torch.zeros_like(x) if g is None else g


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    return bool(torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=False))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (to see whether an input was modified)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


# --- strategies ---------------------------------------------------------------------------

def _draw_mask(draw, B: int, T: int, allow_empty: bool, gaps: bool) -> torch.Tensor:
    """One [B, T] mask: each row full, right-padded, with gaps, or empty."""
    if allow_empty and draw(st.integers(0, 7)) == 0:
        return torch.zeros(B, T, dtype=torch.bool)
    kinds = ["full", "padded"]
    if gaps and T >= 3:
        kinds.append("gaps")
    if allow_empty:
        kinds.append("empty")
    rows = []
    for _ in range(B):
        kind = draw(st.sampled_from(kinds))
        row = [False] * T
        if kind == "full":
            row = [True] * T
        elif kind == "padded":
            length = draw(st.integers(1, T))
            row[:length] = [True] * length
        elif kind == "gaps":  # tool / observation tokens between counted ones
            length = draw(st.integers(3, T))
            row[:length] = [True] * length
            for _ in range(draw(st.integers(1, 2))):
                start = draw(st.integers(1, length - 2))
                stop = draw(st.integers(start + 1, length - 1))
                row[start:stop] = [False] * (stop - start)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).view(B, T)


def _draw_masks(draw, batch_size, length, allow_empty, gaps):
    B = draw(st.integers(*batch_size))
    T = draw(st.integers(*length))
    return _draw_mask(draw, B, T, allow_empty, gaps)


def masks(
    *,
    batch_size: int | tuple[int, int] = (1, 6),
    length: int | tuple[int, int] = (1, 12),
    allow_empty: bool = True,
    gaps: bool = True,
):
    """Strategy for realistic [B, T] bool masks (True = the token counts).

    Each row is, at random: full (T counted tokens); right-padded (the first L tokens
    counted, ``1 <= L <= T``); with gaps (the first L tokens, less one or two runs of
    masked tool / observation tokens strictly inside them, when ``T >= 3``); or empty.
    Some masks (roughly one in six) are empty as a whole.

    Args:
        batch_size: B, an int or an inclusive ``(low, high)`` range; >= 1.
        length: T, an int or an inclusive ``(low, high)`` range; >= 1.
        allow_empty: draw empty rows and wholly empty masks; False gives every row at
            least one counted token.
        gaps: draw rows with masked runs inside them.

    Returns:
        A hypothesis strategy of [B, T] ``torch.bool`` tensors.

    Example:
        >>> import torch
        >>> from hypothesis import given, settings
        >>> @settings(max_examples=10, deadline=None)
        ... @given(mask=masks(batch_size=2, length=5, allow_empty=False))
        ... def test(mask):
        ...     assert mask.shape == (2, 5) and mask.dtype == torch.bool
        ...     assert mask.any(-1).all()
        >>> test()
    """
    fn = "masks"
    _require_hypothesis(fn)
    return st.composite(_draw_masks)(
        _bounds(fn, "batch_size", batch_size, 1), _bounds(fn, "length", length, 1), allow_empty, gaps
    )


def _draw_group(draw, G: int, allow_nan: bool) -> list[float]:
    """The G rewards of one group."""
    kinds = ["scores", "binary", "constant"] + (["nan"] if allow_nan else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "scores":
        values = draw(st.lists(st.integers(-640, 640), min_size=G, max_size=G))
        values = [v * _REWARD_STEP for v in values]
    elif kind == "binary":  # verifiable rewards: ties galore
        values = draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=G, max_size=G))
    elif kind == "constant":
        values = [draw(st.sampled_from(_TIE_VALUES))] * G
    else:
        values = [math.nan] * G
    if allow_nan and kind != "nan" and draw(st.booleans()):
        holes = draw(st.lists(st.booleans(), min_size=G, max_size=G))
        values = [math.nan if hole else v for v, hole in zip(values, holes)]
    return values


def _draw_group_rewards(draw, group_size, num_groups, allow_nan):
    G = draw(st.integers(*group_size))
    n = draw(st.integers(*num_groups))
    values = [v for _ in range(n) for v in _draw_group(draw, G, allow_nan)]
    return torch.tensor(values, dtype=torch.float32), G


def group_rewards(
    *,
    group_size: int | tuple[int, int] = (1, 6),
    num_groups: int | tuple[int, int] = (1, 4),
    allow_nan: bool = True,
):
    """Strategy for [B] sequence rewards in contiguous groups of G (B = prompts x G).

    Each group is, at random: scores (multiples of 1/64 in [-10, 10], exact in float32);
    binary 0 / 1 rewards (many ties, sometimes all equal); a constant (all equal, some
    constants such as 0.1 not representable in binary); or, with ``allow_nan``, all NaN.
    With ``allow_nan``, a group may also have some entries replaced by NaN, the "not
    applicable" reward.

    Args:
        group_size: G, an int or an inclusive ``(low, high)`` range; >= 1.
        num_groups: the number of prompts, an int or an inclusive range; >= 1.
        allow_nan: draw NaN rewards.

    Returns:
        A hypothesis strategy of ``(rewards, group_size)`` pairs: a [B] float32 tensor
        and the int G it is grouped by, ``B % G == 0``.

    Example:
        >>> import torch
        >>> from hypothesis import given, settings
        >>> @settings(max_examples=10, deadline=None)
        ... @given(case=group_rewards(group_size=4, num_groups=(1, 3)))
        ... def test(case):
        ...     rewards, G = case
        ...     assert G == 4 and rewards.shape[0] % 4 == 0 and rewards.dtype == torch.float32
        >>> test()
    """
    fn = "group_rewards"
    _require_hypothesis(fn)
    return st.composite(_draw_group_rewards)(
        _bounds(fn, "group_size", group_size, 1), _bounds(fn, "num_groups", num_groups, 1), allow_nan
    )


def _related_logits(g: torch.Generator, B: int, T: int, V: int, drifts: Sequence[float]):
    """Logits [B, T, V] of a policy, and of one relative per drift: ``logits + drift * noise``."""
    logits = 2.0 * torch.randn(B, T, V, generator=g)
    others = [logits + d * torch.randn(B, T, V, generator=g) for d in drifts]
    return logits, others


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    # x - logsumexp(x), not torch.log_softmax: on a busy CPU the latter's thread pool costs
    # ~10 ms even for these tiny tensors.
    x = logits.float()
    return x - x.logsumexp(-1, keepdim=True)


def _sample(g: torch.Generator, logits: torch.Tensor) -> torch.Tensor:
    B, T, V = logits.shape
    probs = _log_softmax(logits).exp().reshape(-1, V)
    return torch.multinomial(probs, 1, generator=g).view(B, T)


def _token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return _log_softmax(logits).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _draw_policy_pairs(draw, batch_size, length, vocab_size, max_drift, dtype):
    B = draw(st.integers(*batch_size))
    T = draw(st.integers(*length))
    V = draw(st.integers(*vocab_size))
    drift = draw(st.floats(0.0, max_drift))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits, (ref_logits,) = _related_logits(g, B, T, V, [drift])
    logits, ref_logits = logits.to(dtype), ref_logits.to(dtype)
    tokens = _sample(g, logits)
    return TensorDict(
        {
            "logits": logits,
            "ref_logits": ref_logits,
            "tokens": tokens,
            "log_probs": _token_log_probs(logits, tokens),
            "ref_log_probs": _token_log_probs(ref_logits, tokens),
        },
        batch_size=[B],
    )


def policy_pairs(
    *,
    batch_size: int | tuple[int, int] = (1, 4),
    length: int | tuple[int, int] = (1, 8),
    vocab_size: int | tuple[int, int] = (2, 8),
    max_drift: float = 1.0,
    dtype: torch.dtype = torch.float32,
):
    """Strategy for two related policies: logits, sampled tokens and both log-probs.

    ``logits = 2 * z`` and ``ref_logits = logits + drift * z'`` with ``z, z'`` standard
    normal [B, T, V] and ``drift`` drawn in ``[0, max_drift]`` (0: equal policies);
    ``tokens ~ softmax(logits)``; ``log_probs`` and ``ref_log_probs`` are the float32
    log-softmax of each set of logits at those tokens.

    Args:
        batch_size: B, an int or an inclusive ``(low, high)`` range; >= 1.
        length: T, an int or an inclusive range; >= 1.
        vocab_size: V, an int or an inclusive range; >= 1.
        max_drift: largest scale of the difference between the two policies' logits; >= 0.
        dtype: dtype of the two logits tensors (the log-probs are always float32).

    Returns:
        A hypothesis strategy of ``TensorDict`` with ``batch_size=[B]`` and keys
        ``logits``, ``ref_logits`` ([B, T, V]), ``tokens`` ([B, T] int64),
        ``log_probs``, ``ref_log_probs`` ([B, T] float32); ``exact_kl(pair)`` and
        ``approx_kl(pair)`` read their arguments from it.

    Example:
        >>> import torch
        >>> from hypothesis import given, settings
        >>> from torchforge.kl import exact_kl
        >>> @settings(max_examples=10, deadline=None)
        ... @given(pair=policy_pairs(vocab_size=4))
        ... def test(pair):
        ...     assert pair["logits"].shape[-1] == 4
        ...     assert (exact_kl(pair) >= -1e-6).all()
        >>> test()
    """
    fn = "policy_pairs"
    _require_hypothesis(fn)
    if not (isinstance(max_drift, (int, float)) and max_drift >= 0):
        raise InvalidArgumentError(f"{fn}: max_drift must be a number >= 0, got {max_drift!r}")
    return st.composite(_draw_policy_pairs)(
        _bounds(fn, "batch_size", batch_size, 1), _bounds(fn, "length", length, 1),
        _bounds(fn, "vocab_size", vocab_size, 1), float(max_drift), dtype,
    )


def _draw_batches(draw, batch_size, length, group_size, vocab_size, max_drift, advantage_level,
                  nan_outside_mask, allow_empty, gaps, dtype):
    if group_size is None:
        G = 1
        B = draw(st.integers(*batch_size))
    else:
        G = draw(st.integers(*group_size))
        low, high = max(1, -(-batch_size[0] // G)), max(1, batch_size[1] // G)
        B = G * draw(st.integers(low, max(low, high)))
    T = draw(st.integers(*length))
    V = vocab_size
    mask = _draw_mask(draw, B, T, allow_empty, gaps)
    rewards = torch.tensor([v for _ in range(B // G) for v in _draw_group(draw, G, False)])
    level = draw(st.sampled_from(["sequence", "token"])) if advantage_level == "any" else advantage_level
    old_drift = draw(st.floats(0.0, max_drift))
    ref_drift = draw(st.floats(0.0, max_drift))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    # pi (trained), pi_old (sampled the tokens), ref; rollout: pi_old as another engine sees it
    logits, (old_logits, ref_logits) = _related_logits(g, B, T, V, [old_drift, ref_drift])
    tokens = _sample(g, old_logits)
    old_log_probs = _token_log_probs(old_logits, tokens)
    rollout_log_probs = (old_log_probs + 1e-3 * torch.randn(B, T, generator=g)).clamp(max=0.0)
    values = torch.randn(B, T, generator=g)
    data = {
        "tokens": tokens,
        "mask": mask,
        "log_probs": _token_log_probs(logits, tokens),
        "old_log_probs": old_log_probs,
        "ref_log_probs": _token_log_probs(ref_logits, tokens),
        "rollout_log_probs": rollout_log_probs,
        "values": values,
        "old_values": values + 0.1 * old_drift * torch.randn(B, T, generator=g),
        "returns": torch.randn(B, T, generator=g),
    }
    advantages = torch.randn((B,) if level == "sequence" else (B, T), generator=g)
    if nan_outside_mask:
        for key in ("log_probs", "old_log_probs", "ref_log_probs", "rollout_log_probs",
                    "values", "old_values", "returns"):
            data[key] = data[key].masked_fill(~mask, math.nan)
        keep = mask if level == "token" else mask.any(-1)
        advantages = advantages.masked_fill(~keep, math.nan)
    data = {k: v.to(dtype) if v.is_floating_point() else v for k, v in data.items()}
    data["advantages"] = advantages.to(dtype)
    data["rewards"] = rewards.to(dtype)
    return TensorDict(data, batch_size=[B])


def batches(
    *,
    batch_size: int | tuple[int, int] = (1, 6),
    length: int | tuple[int, int] = (1, 12),
    group_size: int | tuple[int, int] | None = None,
    vocab_size: int = 8,
    max_drift: float = 0.5,
    advantage_level: str = "any",
    nan_outside_mask: bool = False,
    allow_empty: bool = True,
    gaps: bool = True,
    dtype: torch.dtype = torch.float32,
):
    """Strategy for ``TensorDict`` batches in the torchforge key vocabulary.

    Three related policies over a vocabulary of ``vocab_size``: ``logits = 2 z``,
    ``old_logits = logits + d_old z_1``, ``ref_logits = logits + d_ref z_2`` (``z`` standard
    normal, ``d_old``, ``d_ref`` drawn in ``[0, max_drift]``; 0 is on-policy). Tokens are
    sampled from the old policy, which produced the batch; ``log_probs``,
    ``old_log_probs`` and ``ref_log_probs`` are each policy's log-probs of those tokens, and
    ``rollout_log_probs`` the old ones with a 1e-3 "engine mismatch" noise. ``mask`` is
    drawn as in :func:`masks`; ``rewards`` as in :func:`group_rewards` (without NaN);
    ``advantages``, ``values``, ``returns`` are standard normal, ``old_values`` close to
    ``values``.

    Args:
        batch_size: B, an int or an inclusive ``(low, high)`` range; >= 1. With
            ``group_size``, B is a multiple of G in that range (the smallest multiple
            above it if there is none).
        length: T, an int or an inclusive range; >= 1.
        group_size: G for the rewards' groups, an int or a range; None: groups of 1.
        vocab_size: V of the policies the tokens are sampled from; >= 1.
        max_drift: largest scale of the logit differences between the policies; >= 0.
        advantage_level: ``"sequence"`` ([B] advantages), ``"token"`` ([B, T]) or
            ``"any"`` (either, at random).
        nan_outside_mask: put NaN in every float [B, T] key where ``mask`` is False, and in
            the [B] advantages of empty rows: a NaN outside the mask must not leak.
        allow_empty: draw empty rows and wholly empty masks.
        gaps: draw masked runs (tool / observation tokens) inside rows.
        dtype: float dtype of every float key.

    Returns:
        A hypothesis strategy of ``TensorDict`` with ``batch_size=[B]`` and keys
        ``tokens`` [B, T] int64, ``mask`` [B, T] bool, ``log_probs``, ``old_log_probs``,
        ``ref_log_probs``, ``rollout_log_probs``, ``values``, ``old_values``, ``returns``
        [B, T], ``rewards`` [B] and ``advantages`` [B] or [B, T].

    Example:
        >>> import torch
        >>> from hypothesis import given, settings
        >>> from torchforge.losses import ppo_loss
        >>> @settings(max_examples=10, deadline=None)
        ... @given(batch=batches(group_size=2, nan_outside_mask=True))
        ... def test(batch):
        ...     assert batch.batch_size[0] % 2 == 0 and batch["rewards"].dim() == 1
        ...     loss, _ = ppo_loss(batch)
        ...     assert torch.isfinite(loss)
        >>> test()
    """
    fn = "batches"
    _require_hypothesis(fn)
    check_choice(fn, "advantage_level", advantage_level, ADVANTAGE_LEVELS)
    if not (isinstance(max_drift, (int, float)) and max_drift >= 0):
        raise InvalidArgumentError(f"{fn}: max_drift must be a number >= 0, got {max_drift!r}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise InvalidArgumentError(f"{fn}: vocab_size must be an int >= 1, got {vocab_size!r}")
    groups = None if group_size is None else _bounds(fn, "group_size", group_size, 1)
    return st.composite(_draw_batches)(
        _bounds(fn, "batch_size", batch_size, 1), _bounds(fn, "length", length, 1), groups,
        vocab_size, float(max_drift), advantage_level, nan_outside_mask, allow_empty, gaps, dtype,
    )
