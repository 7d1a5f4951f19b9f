"""One-call property checks for KL estimators, advantage estimators, policy losses and aggregation."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from tensordict import TensorDict

from torchforge.errors import InvalidArgumentError, check_choice
from torchforge.reduce import AGGREGATION_MODES, Aggregation, aggregate

try:  # a dev dependency: needed to call the functions here, not to import the module
    import hypothesis
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - exercised only without the dev extra
    hypothesis = st = None

from torchforge.testing.strategies import (
    _SHIFT_STEP,
    ADVANTAGE_LEVELS,
    SHIFT_INVARIANCES,
    _bounds,
    _close,
    _draw_group_rewards,
    _draw_mask,
    _fmt,
    _grad,
    _require_hypothesis,
    _run,
    _same,
    _show,
    _tie_value,
    batches,
    policy_pairs,
)

__all__ = ["check_kl_estimator", "check_advantage_estimator", "check_policy_loss", "check_aggregation_exact"]


# --- check_kl_estimator -------------------------------------------------------------------

def _draw_categorical(draw, max_drift):
    """Logits of a categorical pi over V <= 6 outcomes, and the logit shift to ref."""
    V = draw(st.integers(2, 6))
    logits = draw(st.lists(st.floats(-3.0, 3.0, width=32), min_size=V, max_size=V))
    shift = draw(st.lists(st.floats(-max_drift, max_drift, width=32), min_size=V, max_size=V))
    return logits, shift


def _kl_output(out, shape, what: str, inputs: str) -> torch.Tensor:
    fn = "check_kl_estimator"
    if not isinstance(out, torch.Tensor):
        raise AssertionError(f"{fn}: fn returned {type(out).__name__} on {what}; expected a tensor\n{inputs}")
    if out.shape != shape or not out.is_floating_point():
        raise AssertionError(
            f"{fn}: fn returned shape {tuple(out.shape)}, dtype {out.dtype} on {what}; expected a "
            f"float tensor of the input shape {tuple(shape)} (one estimate per token)\n{inputs}"
        )
    if not torch.isfinite(out).all():
        raise AssertionError(f"{fn}: fn returned non-finite estimates on {what}:\n{inputs}\n  out = {_fmt(out)}")
    return out.detach()


def check_kl_estimator(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    nonnegative: bool = False,
    unbiased: bool = True,
    num_samples: int = 20_000,
    sigmas: float = 5.0,
    log_prob_floor: float = -50.0,
    max_examples: int = 25,
) -> None:
    """Check a per-token KL estimator ``fn(log_probs, ref_log_probs) -> [B, T]``.

    Properties, on drawn inputs (:func:`policy_pairs`, and arbitrary log-prob pairs down
    to ``log_prob_floor``):

    - the output is a float tensor of the input shape, finite;
    - ``fn(lp, lp) == 0`` (equal policies: no divergence), within 1e-6;
    - with ``nonnegative``: every estimate ``>= -1e-6``;
    - with ``unbiased``: for a categorical pi and ref over V <= 6 outcomes (log-ratios
      bounded by 3, so the sample variance is meaningful), ``num_samples`` tokens
      ``y ~ pi`` give ``|mean_y fn(log pi(y), log ref(y)) - KL(pi || ref)| <= sigmas * SE
      + 1e-5`` with ``SE = std / sqrt(num_samples)`` the standard error of the mean, and
      ``KL(pi || ref) = sum_y pi(y) (log pi(y) - log ref(y))`` computed exactly.

    Args:
        fn: the estimator; called with two [B, T] float32 tensors.
        nonnegative: check that every estimate is >= 0 (k2, k3).
        unbiased: check ``E_pi[fn] = KL(pi || ref)`` (k1, k3; not k2).
        num_samples: tokens per Monte Carlo estimate; more detects smaller biases.
        sigmas: allowed distance, in standard errors, of the Monte Carlo mean from the KL.
        log_prob_floor: smallest log-prob in the arbitrary pairs (< 0).
        max_examples: hypothesis examples, besides one fixed far-apart pair.

    Returns:
        None; raises ``AssertionError`` with a counterexample when a property fails.

    Example:
        >>> from torchforge.kl import approx_kl
        >>> check_kl_estimator(lambda lp, ref: approx_kl(lp, ref, estimator="k1"), max_examples=5)
        >>> try:  # 1.1 * k1 overestimates KL(pi || ref) by 10%
        ...     check_kl_estimator(lambda lp, ref: 1.1 * (lp - ref), max_examples=5)
        ... except AssertionError as e:
        ...     print("not unbiased" in str(e))
        True

    References:
        J. Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html
    """
    name = "check_kl_estimator"
    _require_hypothesis(name)
    if not (isinstance(num_samples, int) and num_samples >= 100):
        raise InvalidArgumentError(f"{name}: num_samples must be an int >= 100, got {num_samples!r}")
    if not log_prob_floor < 0:
        raise InvalidArgumentError(f"{name}: log_prob_floor must be < 0, got {log_prob_floor!r}")
    atol = 1e-6
    max_drift = 1.5  # |log pi - log ref| <= 2 * max_drift = 3: a bounded ratio, the CLT applies

    def per_token_checks(lp: torch.Tensor, ref: torch.Tensor, what: str) -> None:
        inputs = _show(log_probs=lp, ref_log_probs=ref)
        out = _kl_output(fn(lp.clone(), ref.clone()), lp.shape, what, inputs)
        if nonnegative and not (out >= -atol).all():
            raise AssertionError(
                f"{name}: fn claims nonnegative=True but returned {out.min().item():.3g} on {what}:\n"
                f"{inputs}\n  out = {_fmt(out)}"
            )
        zero = _kl_output(fn(lp.clone(), lp.clone()), lp.shape, f"equal policies ({what})",
                          _show(log_probs=lp, ref_log_probs=lp))
        if not (zero.abs() <= atol).all():
            raise AssertionError(
                f"{name}: fn(log_probs, log_probs) should be 0 (equal policies) but is\n"
                f"  out = {_fmt(zero)}\n{_show(log_probs=lp)}"
            )

    def monte_carlo(logits: list[float], shift: list[float]) -> None:
        x = torch.tensor(logits, dtype=torch.float64)
        x_ref = x + torch.tensor(shift, dtype=torch.float64)
        log_pi, log_ref = x - x.logsumexp(-1), x_ref - x_ref.logsumexp(-1)
        kl = float((log_pi.exp() * (log_pi - log_ref)).sum())
        g = torch.Generator().manual_seed(0)
        n = num_samples - num_samples % 100
        y = torch.multinomial(log_pi.exp(), n, replacement=True, generator=g).view(-1, 100)
        lp, ref = log_pi[y].float(), log_ref[y].float()
        what = f"{n} tokens sampled from pi"
        dist = _show(pi=log_pi.exp().float(), ref=log_ref.exp().float())
        out = _kl_output(fn(lp, ref), lp.shape, what, dist).double()
        if nonnegative and not (out >= -atol).all():
            raise AssertionError(
                f"{name}: fn claims nonnegative=True but returned {out.min().item():.3g} on {what} of\n{dist}"
            )
        if not unbiased:
            return
        mean, se = float(out.mean()), float(out.std()) / math.sqrt(n)
        if not abs(mean - kl) <= sigmas * se + 1e-5:
            away = abs(mean - kl) / se if se > 0 else math.inf
            raise AssertionError(
                f"{name}: fn claims unbiased=True but is not unbiased for KL(pi || ref): over {n} tokens "
                f"sampled from pi its mean is {mean:.6f} (standard error {se:.2g}), while "
                f"KL(pi || ref) = {kl:.6f}, {away:.1f} standard errors away (allowed: {sigmas}); "
                f"with\n{dist}\nPass unbiased=False if fn is not meant to be unbiased."
            )

    def prop(pair, extremes, categorical) -> None:
        per_token_checks(pair["log_probs"], pair["ref_log_probs"], "log-probs of sampled tokens")
        ext = torch.tensor(extremes, dtype=torch.float32).T.reshape(2, 1, -1)
        per_token_checks(ext[0], ext[1], "extreme log-probs")
        monte_carlo(*categorical)

    # A fixed pair far apart: pi = (0.7, 0.2, 0.1), ref = (0.1, 0.2, 0.7), KL = 0.6 log 7.
    far = [math.log(0.7), math.log(0.2), math.log(0.1)]
    explicit = [dict(
        pair=TensorDict({"log_probs": torch.tensor([far]), "ref_log_probs": torch.tensor([far[::-1]])}, [1]),
        extremes=[(0.0, log_prob_floor), (log_prob_floor, 0.0), (-1e-4, -2e-4)],
        categorical=(far, [b - a for a, b in zip(far, far[::-1])]),
    )]
    floats = st.floats(log_prob_floor, 0.0, width=32)
    _run(name, prop, dict(
        pair=policy_pairs(max_drift=2.0),
        extremes=st.lists(st.tuples(floats, floats), min_size=1, max_size=6),
        categorical=st.composite(_draw_categorical)(max_drift),
    ), max_examples, explicit)


# --- check_advantage_estimator --------------------------------------------------------------

def _draw_advantage_case(draw, group_size, allow_nan):
    rewards, G = _draw_group_rewards(draw, group_size, (1, 4), allow_nan)
    n = rewards.shape[0] // G
    shifts = draw(st.lists(st.integers(-400, 400), min_size=n, max_size=n))
    return rewards, G, torch.tensor(shifts, dtype=torch.float32) * _SHIFT_STEP


def check_advantage_estimator(
    fn: Callable[..., torch.Tensor],
    *,
    group_size: int | tuple[int, int] = (1, 6),
    zero_mean: bool = True,
    ties_zero: bool = True,
    shift_invariant: str | None = "group",
    allow_nan: bool = True,
    max_examples: int = 50,
) -> None:
    """Check a group advantage estimator ``fn(rewards, group_size=G) -> [B]``.

    Properties, on rewards drawn by :func:`group_rewards` (``valid`` = finite reward):

    - the output is a [B] float tensor, finite everywhere (NaN rewards and all-equal
      groups included), and ``rewards`` is not modified;
    - with ``ties_zero``: a group whose valid rewards are all equal (or has fewer than
      two) gets 0 at its valid entries, within 1e-6 (never a blown-up value);
    - with ``zero_mean``: ``|sum_{valid i in g} A_i| <= 1e-5 + 1e-3 * sum |A_i|`` for
      every group g;
    - with ``shift_invariant="group"``: adding a constant ``c_g`` to the rewards of group
      g (a different one per group) leaves every advantage unchanged;
      ``"batch"``: adding one constant to every reward does (e.g. a batch-std scale);
      within ``rtol = 1e-3`` and ``atol = 1e-3 * (1 + max |A|)``.

    Args:
        fn: the estimator; called as ``fn(rewards, group_size=G)`` with [B] float32
            rewards, B = prompts x G, each prompt's G samples contiguous.
        group_size: the G values to draw, an int or an inclusive range (e.g. ``(2, 6)``
            for an estimator that needs two samples).
        zero_mean: check that the advantages of each group sum to 0.
        ties_zero: check that all-equal groups get exactly-zero advantages.
        shift_invariant: ``"group"``, ``"batch"`` or None (no check).
        allow_nan: draw NaN ("not applicable") rewards.
        max_examples: hypothesis examples, besides one fixed batch of degenerate groups.

    Returns:
        None; raises ``AssertionError`` with a counterexample when a property fails.

    Example:
        >>> import torch
        >>> from torchforge.advantages import group_advantages
        >>> check_advantage_estimator(group_advantages, max_examples=5)
        >>> def naive(rewards, *, group_size):      # no tie guard: 0 / 0 on equal rewards
        ...     r = rewards.view(-1, group_size)
        ...     return ((r - r.mean(-1, keepdim=True)) / r.std(-1, keepdim=True)).view(-1)
        >>> try:
        ...     check_advantage_estimator(naive, group_size=(2, 4), allow_nan=False, max_examples=5)
        ... except AssertionError as e:
        ...     print("not finite" in str(e))
        True

    References:
        GRPO (DeepSeekMath), https://arxiv.org/abs/2402.03300; RLOO,
        https://arxiv.org/abs/2402.14740
    """
    name = "check_advantage_estimator"
    _require_hypothesis(name)
    check_choice(name, "shift_invariant", shift_invariant, SHIFT_INVARIANCES)
    sizes = _bounds(name, "group_size", group_size, 1)

    def call(rewards: torch.Tensor, G: int, what: str) -> torch.Tensor:
        before = rewards.clone()
        out = fn(rewards, group_size=G)
        inputs = _show(rewards=before, group_size=G)
        if not _same(rewards, before):
            raise AssertionError(
                f"{name}: fn modified its input rewards ({what}):\n{inputs}\n  after = {_fmt(rewards)}"
            )
        if not isinstance(out, torch.Tensor) or out.shape != rewards.shape or not out.is_floating_point():
            if isinstance(out, torch.Tensor):
                seen = f"shape {tuple(out.shape)}, dtype {out.dtype}"
            else:
                seen = type(out).__name__
            raise AssertionError(f"{name}: fn returned {seen} ({what}); expected a float tensor of shape "
                                 f"{tuple(rewards.shape)}\n{inputs}")
        if not torch.isfinite(out).all():
            raise AssertionError(f"{name}: advantages not finite ({what}):\n{inputs}\n  advantages = {_fmt(out)}")
        return out.detach().double()

    def prop(case) -> None:
        rewards, G, shifts = case
        A = call(rewards, G, "drawn rewards")
        inputs = _show(rewards=rewards, group_size=G, advantages=A.float())
        r, a = rewards.view(-1, G), A.view(-1, G)
        for i in range(r.shape[0]):
            valid = torch.isfinite(r[i])
            vals, adv = r[i][valid], a[i][valid]
            if ties_zero and (vals == vals[:1]).all() and not (adv.abs() <= 1e-6).all():
                raise AssertionError(
                    f"{name}: group {i} has all-equal rewards {_fmt(vals)} but advantages {_fmt(adv.float())}; "
                    f"expected 0 (pass ties_zero=False if fn is not meant to)\n{inputs}"
                )
            if zero_mean and not abs(float(adv.sum())) <= 1e-5 + 1e-3 * float(adv.abs().sum()):
                raise AssertionError(
                    f"{name}: the advantages of group {i} (valid rewards) sum to {float(adv.sum()):.6g}; "
                    f"expected zero mean per group (pass zero_mean=False if fn is not meant to)\n{inputs}"
                )
        if shift_invariant is None:
            return
        shift = shifts.repeat_interleave(G) if shift_invariant == "group" else shifts[0].expand(rewards.shape)
        shifted = rewards + shift
        A2 = call(shifted, G, f"rewards shifted per {shift_invariant}")
        if not _close(A2, A, rtol=1e-3, atol=1e-3 * (1 + float(A.abs().max()))):
            raise AssertionError(
                f"{name}: fn is not invariant to a shift of the rewards per {shift_invariant}: "
                f"adding {_fmt(shifts if shift_invariant == 'group' else shifts[0])} "
                f"changes the advantages\n{inputs}\n  shifted rewards = {_fmt(shifted)}\n"
                f"  advantages after = {_fmt(A2.float())}"
            )

    # Degenerate groups every run sees: all equal (a constant whose mean has a rounding
    # residue), binary ties, spread scores with a NaN (when allowed), shifted differently.
    G = min(max(3, sizes[0]), sizes[1])
    groups = [[_tie_value(G)] * G, [float(i % 2 == 0) for i in range(G)], [i / 8 - 0.5 for i in range(G)]]
    if allow_nan and G >= 2:
        groups[2][-1] = math.nan
    explicit = [dict(case=(torch.tensor(sum(groups, [])), G, torch.tensor([100.25, -3.5, 7.0])))]
    _run(name, prop, dict(case=st.composite(_draw_advantage_case)(sizes, allow_nan)), max_examples, explicit)


# --- check_policy_loss ----------------------------------------------------------------------

def check_policy_loss(
    fn: Callable[..., object],
    *,
    aggregation: str | Aggregation = "token-mean",
    advantage_level: str = "any",
    max_examples: int = 25,
) -> None:
    """Check a policy loss ``fn(log_probs, old_log_probs, advantages, mask)``.

    ``fn`` returns ``(loss, metrics)``: a float scalar and a dict, as every loss does. Properties, on
    batches drawn by :func:`batches`:

    - on-policy gradient: with ``old_log_probs = log_probs.detach()`` (ratio 1), the
      gradient of the loss w.r.t. ``log_probs`` equals that of
      ``aggregate(-A * log_probs, mask, ...)`` with the claimed ``aggregation``: the
      score-function gradient ``-A grad log pi``, reduced as claimed (for
      ``"token-mean"``: ``-A * mask / mask.sum()``);
    - masked == sliced: dropping the rows with no counted token changes neither the loss
      nor the gradient of the kept rows, and the dropped rows get zero gradient;
    - empty mask: loss 0 with a zero (finite) gradient, and finite metrics;
    - no NaN leak: NaN in ``log_probs``, ``old_log_probs`` and ``advantages`` where
      nothing is counted changes neither the loss nor the gradient;
    - the inputs are not modified.

    Args:
        fn: the loss; called with [B, T] float32 ``log_probs`` (requires grad),
            ``old_log_probs``, [B] or [B, T] ``advantages`` and [B, T] bool ``mask``.
            Wrap a loss with another signature in a lambda.
        aggregation: how ``fn`` reduces tokens: a mode name of ``AGGREGATION_MODES`` or an
            :class:`~torchforge.reduce.Aggregation`, with the semantics of
            :func:`~torchforge.reduce.aggregate`.
        advantage_level: the advantages to pass: ``"sequence"`` ([B]), ``"token"``
            ([B, T]) or ``"any"`` (both, at random).
        max_examples: hypothesis examples, besides one fixed batch of uneven rows.

    Returns:
        None; raises ``AssertionError`` with a counterexample when a property fails.

    Example:
        >>> from torchforge.losses import ppo_loss
        >>> check_policy_loss(ppo_loss, max_examples=5)
        >>> try:  # ppo_loss reduces with token-mean, not seq-mean-token-mean
        ...     check_policy_loss(ppo_loss, aggregation="seq-mean-token-mean", max_examples=5)
        ... except AssertionError as e:
        ...     print("on-policy gradient" in str(e))
        True

    References:
        R. J. Williams (1992), the score-function gradient; PPO,
        https://arxiv.org/abs/1707.06347; the masked == sliced property of optax's tests.
    """
    name = "check_policy_loss"
    _require_hypothesis(name)
    check_choice(name, "advantage_level", advantage_level, ADVANTAGE_LEVELS)
    agg = Aggregation.of(aggregation)
    check_choice(name, "aggregation mode", agg.mode, AGGREGATION_MODES)

    def run(lp0, old, A, mask, what):
        """(loss, metrics, grad) of fn, with inputs cloned and checked for modification."""
        lp = lp0.detach().clone().requires_grad_(True)
        args = [old.clone(), A.clone(), mask.clone()]
        out = fn(lp, *args)
        inputs = _show(log_probs=lp0, old_log_probs=old, advantages=A, mask=mask)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
            raise AssertionError(
                f"{name}: fn returned {type(out).__name__}"
                + (f" of {len(out)} items" if isinstance(out, tuple) else "")
                + f" ({what}); expected (loss, metrics) with metrics a dict, as every torchforge loss returns"
            )
        loss, metrics = out
        for arg, original, arg_name in zip([lp] + args, [lp0, old, A, mask],
                                           ["log_probs", "old_log_probs", "advantages", "mask"]):
            if not _same(arg.detach(), original.detach()):
                raise AssertionError(f"{name}: fn modified its input {arg_name} ({what}):\n{inputs}")
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
            seen = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise AssertionError(f"{name}: the loss is {seen} ({what}); expected a float scalar tensor\n{inputs}")
        return loss, metrics, _grad(loss, lp), inputs

    def prop(batch) -> None:
        lp0, old, A, mask = (batch[k] for k in ("log_probs", "old_log_probs", "advantages", "mask"))

        # On-policy: ratio 1, the gradient is the score function -A grad log pi, aggregated.
        loss, _, grad, inputs = run(lp0, lp0.detach().clone(), A, mask, "on-policy")
        ref = lp0.detach().clone().requires_grad_(True)
        A_tok = A.unsqueeze(-1) if A.dim() == 1 else A
        expected = _grad(agg(-A_tok * ref, mask), ref)
        if not _close(grad, expected, rtol=1e-4, atol=1e-6):
            raise AssertionError(
                f"{name}: the on-policy gradient (old_log_probs = log_probs) of the loss w.r.t. log_probs "
                f"is not that of aggregate(-advantages * log_probs, mask, mode={agg.mode!r}):\n"
                f"  gradient = {_fmt(grad)}\n  expected = {_fmt(expected)}\n{inputs}"
            )

        # Off-policy, as drawn: the reference values of the next three properties.
        loss, _, grad, inputs = run(lp0, old, A, mask, "off-policy")
        if not torch.isfinite(loss) or not torch.isfinite(grad).all():
            raise AssertionError(f"{name}: loss {loss.item()} or its gradient is not finite:\n"
                                 f"  gradient = {_fmt(grad)}\n{inputs}")

        # Masked == sliced: drop the rows with nothing counted.
        keep = mask.any(-1)
        if keep.any() and not keep.all():
            loss_s, _, grad_s, _ = run(lp0[keep], old[keep], A[keep], mask[keep], "rows sliced")
            if not (_close(loss_s, loss, 1e-5, 1e-6) and _close(grad_s, grad[keep], 1e-4, 1e-6)
                    and (grad[~keep] == 0).all()):
                raise AssertionError(
                    f"{name}: dropping the rows with no counted token changes the loss ({loss.item():.6g} "
                    f"with them, {loss_s.item():.6g} without) or the gradient:\n  gradient = {_fmt(grad)}\n"
                    f"  gradient sliced = {_fmt(grad_s)}\n{inputs}"
                )

        # Empty mask: zero loss, zero gradient, finite metrics.
        empty = torch.zeros_like(mask)
        loss_e, metrics_e, grad_e, inputs_e = run(lp0, old, A, empty, "empty mask")
        bad = [k for k, v in metrics_e.items() if isinstance(v, torch.Tensor) and not torch.isfinite(v).all()]
        if not (loss_e.abs() <= 1e-7 and (grad_e == 0).all() and not bad):
            raise AssertionError(
                f"{name}: with an empty mask the loss should be 0 with zero gradient and finite metrics; "
                f"got loss {loss_e.item()}, gradient {_fmt(grad_e)}, non-finite metrics {bad}\n{inputs_e}"
            )

        # No NaN leak: NaN wherever nothing is counted.
        if (~mask).any():
            keep_A = mask.any(-1) if A.dim() == 1 else mask
            lp_n, old_n = lp0.masked_fill(~mask, math.nan), old.masked_fill(~mask, math.nan)
            A_n = A.masked_fill(~keep_A, math.nan)
            loss_n, metrics_n, grad_n, inputs_n = run(lp_n, old_n, A_n, mask, "NaN outside the mask")
            bad = [k for k, v in metrics_n.items()
                   if isinstance(v, torch.Tensor) and not torch.isfinite(v).all()]
            if not (_close(loss_n, loss, 1e-5, 1e-7) and _close(grad_n, grad, 1e-5, 1e-7) and not bad):
                raise AssertionError(
                    f"{name}: NaN at positions where mask is False leaks: loss {loss_n.item()} (without the "
                    f"NaN: {loss.item()}), gradient {_fmt(grad_n)}, non-finite metrics {bad}\n{inputs_n}"
                )

    # Rows of different lengths (one with a gap, one empty): wrong normalizations show.
    mask = torch.tensor([[True, True, True, False], [True, False, False, False],
                         [False, False, False, False], [True, False, True, True]])
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.6, 0.3], [0.9, 0.5, 0.5, 0.5],
                                 [0.3, 0.3, 0.3, 0.3], [0.2, 0.7, 0.4, 0.8]]))
    token_level = advantage_level == "token"
    A = torch.tensor([[1.0, -0.5, 2.0, 0.3], [-1.0, 0.4, 0.1, 0.0], [0.5, 0.5, 0.5, 0.5],
                      [0.7, -2.0, 0.2, -0.3]]) if token_level else torch.tensor([1.0, -2.0, 0.5, 0.7])
    fixed = TensorDict({"log_probs": lp, "old_log_probs": lp + 0.1 * torch.tensor([1.0, -1.0, 0.5, -2.0]),
                        "advantages": A, "mask": mask}, batch_size=[4])
    _run(name, prop, dict(batch=batches(length=(1, 10), advantage_level=advantage_level)),
         max_examples, [dict(batch=fixed)])


# --- check_aggregation_exact ---------------------------------------------------------------

class _AggregationCase(NamedTuple):
    per_token: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] bool
    mode: str
    dp_size: int
    sizes: tuple[int, ...]  # rows of each micro-batch, rank-major: dp_size * micro-batches
    tensor_counts: bool  # pass the global counts as tensors (True) or ints


def _draw_aggregation_case(draw, modes, nan_outside_mask):
    R = draw(st.integers(1, 3))
    M = draw(st.integers(1, 3))
    k = R * M
    B = draw(st.integers(k, k + 4))
    T = draw(st.integers(1, 8))
    mask = _draw_mask(draw, B, T, True, True)
    cuts = sorted(draw(st.lists(st.integers(1, B - 1), min_size=k - 1, max_size=k - 1, unique=True))) if k > 1 else []
    sizes = tuple(b - a for a, b in zip([0] + cuts, cuts + [B]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    per_token = torch.randn(B, T, generator=g)
    if nan_outside_mask:
        per_token = per_token.masked_fill(~mask, math.nan)
    return _AggregationCase(per_token, mask, draw(st.sampled_from(modes)), R, sizes, draw(st.booleans()))


def check_aggregation_exact(
    fn: Callable[..., torch.Tensor],
    *,
    modes: Sequence[str] = AGGREGATION_MODES,
    reference: Callable[..., torch.Tensor] | None = aggregate,
    nan_outside_mask: bool = True,
    max_examples: int = 25,
) -> None:
    """Check that a loss aggregation is exact across micro-batches and data-parallel ranks.

    ``fn(per_token, mask, *, mode, num_tokens, num_sequences, dp_size)`` reduces a [B, T]
    per-token loss to a scalar with the semantics of :func:`~torchforge.reduce.aggregate`.
    A drawn batch is split, by rows, over ``R = dp_size`` ranks of ``M`` micro-batches each
    (uneven sizes, empty rows included); with ``N`` the counted tokens and ``S`` the
    sequences with a counted token of the *whole* batch, the property is

    ``(1 / R) sum_r sum_m fn(chunk_rm, mask_rm, mode=mode, num_tokens=N,
    num_sequences=S, dp_size=R) == fn(per_token, mask, mode=mode, num_tokens=N,
    num_sequences=S, dp_size=1)``

    for the value and for the gradient w.r.t. ``per_token`` (what gradient accumulation
    then DDP / FSDP averaging compute), within ``rtol = 1e-5``, ``atol = 1e-6``. With a
    ``reference``, the one-process value must also equal ``reference(per_token, mask,
    mode=mode)``. The counts are passed as Python ints or as int64 scalar tensors, at
    random.

    Args:
        fn: the aggregation (e.g. ``torchforge.reduce.aggregate``).
        modes: the modes ``fn`` claims to aggregate exactly; each is passed as ``mode=``.
        reference: the one-process semantics to match; None checks exactness only (for
            modes of your own).
        nan_outside_mask: put NaN in ``per_token`` where ``mask`` is False (it must not leak).
        max_examples: hypothesis examples, besides one fixed uneven split per mode.

    Returns:
        None; raises ``AssertionError`` with a counterexample when a property fails.

    Example:
        >>> from torchforge.reduce import aggregate
        >>> check_aggregation_exact(aggregate, max_examples=5)
        >>> def per_rank_mean(per_token, mask, *, mode, num_tokens, num_sequences, dp_size):
        ...     return aggregate(per_token, mask, mode=mode)  # ignores the global counts
        >>> try:
        ...     check_aggregation_exact(per_rank_mean, modes=["token-mean"], max_examples=5)
        ... except AssertionError as e:
        ...     print("one process gives" in str(e))
        True

    References:
        DAPO (token-mean), https://arxiv.org/abs/2503.14476; Dr. GRPO,
        https://arxiv.org/abs/2503.20783
    """
    name = "check_aggregation_exact"
    _require_hypothesis(name)
    modes = tuple(modes)
    if not modes or not all(isinstance(m, str) for m in modes):
        raise InvalidArgumentError(f"{name}: modes must be a non-empty sequence of mode names, got {modes!r}")

    def value_and_grad(per_token, mask, **kwargs):
        x = per_token.detach().clone().requires_grad_(True)
        out = fn(x, mask.clone(), **kwargs)
        if not (isinstance(out, torch.Tensor) and out.dim() == 0 and out.is_floating_point()):
            seen = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise AssertionError(f"{name}: fn returned {seen}; expected a float scalar tensor")
        return out.detach(), _grad(out, x)

    def prop(case: _AggregationCase) -> None:
        per_token, mask, mode, R, sizes, tensor_counts = case
        N, S = int(mask.sum()), int(mask.any(-1).sum())
        counts = dict(num_tokens=torch.tensor(N), num_sequences=torch.tensor(S)) if tensor_counts else \
            dict(num_tokens=N, num_sequences=S)
        M = len(sizes) // R
        split = f"dp_size={R}, {M} micro-batch(es) per rank, rows per micro-batch {list(sizes)} (rank-major)"
        inputs = _show(per_token=per_token, mask=mask) + f"\n  num_tokens = {N}, num_sequences = {S}"

        whole, grad_whole = value_and_grad(per_token, mask, mode=mode, dp_size=1, **counts)
        if reference is not None:
            expected = reference(per_token, mask, mode=mode)
            if not _close(whole, expected, 1e-5, 1e-6):
                raise AssertionError(
                    f"{name}: mode={mode!r}: fn on the whole batch gives {whole.item():.7g} but the reference "
                    f"gives {expected.item():.7g}\n{inputs}"
                )
        total, grads, start = torch.zeros((), dtype=torch.float64), [], 0
        for size in sizes:
            rows = slice(start, start + size)
            value, grad = value_and_grad(per_token[rows], mask[rows], mode=mode, dp_size=R, **counts)
            total, start = total + value.double() / R, start + size  # sum micro-batches, mean ranks
            grads.append(grad / R)
        grad_split = torch.cat(grads)
        if not (_close(total, whole, 1e-5, 1e-6) and _close(grad_split, grad_whole, 1e-5, 1e-6)):
            raise AssertionError(
                f"{name}: mode={mode!r}, {split}: summing the micro-batch losses and averaging over ranks "
                f"gives {total.item():.7g} but one process gives {whole.item():.7g} (or the gradients differ:\n"
                f"  split gradient = {_fmt(grad_split)}\n  one-process gradient = {_fmt(grad_whole)})\n{inputs}"
            )

    # Two ranks with different token (3, 4) and sequence (1, 2) counts, one with an empty row.
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False], [True, True, True]])
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.5, -1.0], [7.0, 7.0, 7.0], [-2.0, 0.25, 9.0]])
    if nan_outside_mask:
        per_token = per_token.masked_fill(~mask, math.nan)
    explicit = [dict(case=_AggregationCase(per_token, mask, mode, 2, (1, 3), False)) for mode in modes]
    _run(name, prop, dict(case=st.composite(_draw_aggregation_case)(modes, nan_outside_mask)),
         max_examples, explicit)
