"""torchforge.compat.trl against TRL 1.16's own code, on the same float64 inputs.

The reference is TRL's, not a reimplementation: ``trl_loss`` builds a ``GRPOTrainer`` with
``object.__new__`` (no model, no dataset), sets by hand the attributes ``_compute_loss``
reads (from ``GRPOConfig``'s own defaults), replaces ``_get_per_token_logps_and_entropies``
on the instance by one that returns the test's float64 leaf tensors, and calls the real
``_compute_loss``. The vLLM importance-sampling ratio is computed inline in the 300-line
``_generate_and_score_completions``, which cannot run without a generation backend: the
test takes that block's text from TRL's installed source (``inspect.getsource``, located by
its first lines, so a TRL that changes it fails here loudly) and executes it on the test's
tensors.

Tolerance: torchforge computes in float32 (its numerical contract) while TRL computes in
the inputs' float64, so the two agree to float32 rounding; ``_close`` allows 1e-6 of the
largest magnitude compared, far below any difference of semantics (a normalizer, a clip, a
missing term all change results by more than 1e-3).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
import subprocess
import sys
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from torchforge.compat.trl import (
    LOSS_TYPES,
    VLLM_IMPORTANCE_SAMPLING_MODES,
    grpo_loss,
    importance_sampling_kwargs,
    loss_kwargs,
    vllm_importance_sampling_ratio,
)
from torchforge.errors import InvalidArgumentError, ShapeError

REL = 1e-6
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def _trl():
    """TRL's trainer module, or a skip naming the extra."""
    return pytest.importorskip(
        "trl.trainer.grpo_trainer", reason="the TRL equality tests need trl (pip install -e '.[compat]')"
    )


def _close(actual, expected, what):
    """|actual - expected| <= REL * max(|expected|, 1), elementwise, in float64."""
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=0, atol=REL * max(scale, 1.0), msg=lambda m: f"{what}: {m}")


class _Accelerator:
    """One process: gathers and reductions are the identity."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x.reshape(-1)

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def _config(**overrides):
    """GRPOConfig's own field defaults (without its __post_init__, which needs a run), overridden."""
    trl_config = pytest.importorskip("trl.trainer.grpo_config", reason="needs trl")
    fields = {f.name: f.default for f in dataclasses.fields(trl_config.GRPOConfig)
              if f.default is not dataclasses.MISSING}
    fields.update(gradient_accumulation_steps=1, steps_per_generation=None)
    fields.update(overrides)
    if fields["steps_per_generation"] is None:  # as GRPOConfig.__post_init__ sets it
        fields["steps_per_generation"] = fields["gradient_accumulation_steps"]
    return SimpleNamespace(**fields)


def trl_loss(config, lp, entropies, inputs, num_processes=1):
    """TRL's ``GRPOTrainer._compute_loss`` on the given log-probs; returns (loss, metrics)."""
    trainer_cls = _trl().GRPOTrainer
    t = object.__new__(trainer_cls)
    t.args = config
    t.loss_type = config.loss_type
    t.epsilon_low = config.epsilon
    t.epsilon_high = config.epsilon if config.epsilon_high is None else config.epsilon_high
    t.beta = config.beta
    t.importance_sampling_level = config.importance_sampling_level
    t.top_entropy_quantile = config.top_entropy_quantile
    t.off_policy_mask_threshold = config.off_policy_mask_threshold
    t.max_completion_length = config.max_completion_length
    t.use_vllm = "importance_sampling_ratio" in inputs
    t.vllm_importance_sampling_correction = True
    t.aux_loss_enabled = False
    t.entropy_coef = config.entropy_coef
    t.use_adaptive_entropy = False
    t._entropy_bonus_enabled = config.entropy_coef != 0.0
    t.accelerator = _Accelerator()
    t.accelerator.num_processes = num_processes
    t.model = SimpleNamespace(training=True)
    t.current_gradient_accumulation_steps = config.gradient_accumulation_steps
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t._get_per_token_logps_and_entropies = lambda *args, **kwargs: (lp, entropies, None)
    B, T = lp.shape
    full = dict(prompt_ids=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.long),
                completion_ids=torch.zeros(B, T, dtype=torch.long))
    loss = t._compute_loss(None, {**full, **inputs})
    return loss, {k: v[-1] for k, v in t._metrics["train"].items()}


def _trl_block(method, first: str, second: str) -> str:
    """The source of the ``if`` block of ``method`` whose first two lines start with ``first``
    and ``second`` (stripped), dedented."""
    lines = inspect.getsource(method).splitlines()
    for i in range(len(lines) - 1):
        if lines[i].strip().startswith(first) and lines[i + 1].strip().startswith(second):
            indent = len(lines[i]) - len(lines[i].lstrip())
            end = i + 1
            while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
                end += 1
            return textwrap.dedent("\n".join(lines[i:end]))
    raise AssertionError(f"TRL's {method.__qualname__} no longer has the block {first!r} / {second!r}")


def trl_importance_sampling(old, sampling, completion_mask, mode, clip_min, clip_max):
    """TRL's vLLM importance-sampling ratio and its metrics, by TRL's own lines."""
    grpo = _trl()
    method = grpo.GRPOTrainer._generate_and_score_completions
    ratio_code = _trl_block(method, "if self.use_vllm and self.vllm_importance_sampling_correction:",
                            "mask = completion_mask if tool_mask is None")
    metrics_code = _trl_block(method, "if self.use_vllm and self.vllm_importance_sampling_correction:",
                              "delta = torch.abs(old_per_token_logps - sampling_per_token_logps)")
    fake = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True,
                           vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                           vllm_importance_sampling_clip_max=clip_max, accelerator=_Accelerator(),
                           _metrics={"train": defaultdict(list)})
    scope = dict(self=fake, torch=torch, math=math, completion_mask=completion_mask, tool_mask=None,
                 old_per_token_logps=old, sampling_per_token_logps=sampling, mode="train",
                 device=old.device, nanmin=grpo.nanmin, nanmax=grpo.nanmax)
    exec(ratio_code, scope)
    exec(metrics_code, scope)
    return scope["vllm_importance_sampling_ratio"], {k: v[-1] for k, v in fake._metrics["train"].items()}


# --- inputs ------------------------------------------------------------------------------------

def _inputs(kind: str, seed: int = 0, B: int = 6, T: int = 7):
    """float64 ``(lp, old, ref, sampling, A, mask, entropies)``; rows of uneven lengths, one empty.

    kind: ``"ordinary"``; ``"extreme"`` (log-ratios of +-50 to the old and the reference
    policy, and between trainer and sampler); ``"offset"`` (advantages of 1e4 + N(0, 1));
    ``"empty"`` (no counted token). The entropies are float32-representable too: TRL
    compares the float64 entropies with a quantile of their float32 cast.
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, 3, 0, 5, 1, T - 1])[:B]
    mask = (torch.arange(T) < lengths.unsqueeze(-1)).long()
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    sampling = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    A = torch.randn(B, generator=g, dtype=torch.float64)
    entropies = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    if kind == "extreme":
        # pi / pi_old = e^(+-50) and ref / pi = e^(-+50) on the same token: the bias-corrected
        # KL's product stays near e^50 (two e^50 factors, e^100, overflow float32, TRL's too)
        sign = torch.where(torch.rand(B, T, generator=g) < 0.5, -1.0, 1.0).double()
        old = lp - 50 * sign
        ref = lp - 50 * sign
        sampling = old + 50 * sign.flip(1)
    elif kind == "offset":
        A = A + 1e4
    elif kind == "empty":
        mask = torch.zeros_like(mask)
    # Every input exactly representable in float32 (multiples of 2^-12; of 2^-9 for the
    # advantages): the comparison then measures the maths' rounding, not the inputs' cast.
    lp, old, ref, sampling, entropies = (torch.round(x * 4096) / 4096 for x in (lp, old, ref, sampling, entropies))
    return lp, old, ref, sampling, torch.round(A * 512) / 512, mask, entropies


def _loss_config(loss_type, level="token", beta=0.0, delta=None, **overrides):
    epsilon_high = 5.0 if loss_type == "cispo" else 0.28
    return _config(loss_type=loss_type, importance_sampling_level=level, beta=beta, delta=delta,
                   epsilon_high=epsilon_high, max_completion_length=7, **overrides)


def _both(config, kind, is_mode=None, clip_min=None, seed=0, num_items_in_batch=None, num_processes=1):
    """Loss, gradients and metrics of TRL and of compat on the same inputs."""
    lp0, old, ref, sampling, A, mask, entropies0 = _inputs(kind, seed)
    trl_inputs = dict(advantages=A, completion_mask=mask, old_per_token_logps=old, ref_per_token_logps=ref,
                      sampling_per_token_logps=sampling)
    is_ratio = None
    if is_mode is not None:
        trl_inputs["importance_sampling_ratio"], _ = trl_importance_sampling(old, sampling, mask, is_mode,
                                                                             clip_min, 3.0)
        is_ratio, _ = vllm_importance_sampling_ratio(old, sampling, mask, vllm_importance_sampling_mode=is_mode,
                                                     vllm_importance_sampling_clip_min=clip_min)
    count = torch.tensor(float(mask.sum())) if num_items_in_batch is None else torch.tensor(num_items_in_batch)
    trl_inputs["num_items_in_batch"] = count

    lp, entropies = lp0.clone().requires_grad_(), entropies0.clone().requires_grad_()
    loss_t, metrics_t = trl_loss(config, lp, entropies, trl_inputs, num_processes)
    grads_t = torch.autograd.grad(loss_t, (lp, entropies), allow_unused=True, materialize_grads=True)

    lp, entropies = lp0.clone().requires_grad_(), entropies0.clone().requires_grad_()
    loss_c, metrics_c = grpo_loss(lp, old, A, mask, ref, is_ratio, entropies, sampling,
                                  num_items_in_batch=num_items_in_batch, num_processes=num_processes,
                                  **loss_kwargs(config))
    grads_c = torch.autograd.grad(loss_c, (lp, entropies), allow_unused=True, materialize_grads=True)
    return (loss_t, grads_t, metrics_t), (loss_c, grads_c, metrics_c), mask


def _assert_equal(trl, ours, mask, what):
    (loss_t, grads_t, metrics_t), (loss_c, grads_c, metrics_c) = trl, ours
    assert torch.isfinite(loss_t), f"{what}: TRL's loss is {loss_t}"
    _close(loss_c, loss_t, f"{what}: loss")
    _close(grads_c[0], grads_t[0], f"{what}: gradient w.r.t. per_token_logps")
    _close(grads_c[1], grads_t[1], f"{what}: gradient w.r.t. entropies")
    assert set(metrics_c) == set(metrics_t) - {"entropy_coef"}, what
    for name, value in metrics_t.items():
        if name == "entropy_coef":
            continue
        if math.isnan(value):  # TRL's nanmin / nanmax of no row: compat keeps its metrics finite
            assert not mask.any() and metrics_c[name] == 0, f"{what}: {name}"
        else:
            _close(metrics_c[name], value, f"{what}: metric {name}")


# --- equality: every loss type x level x beta x delta x IS mode, at four kinds of input --------

def _matrix():
    for loss_type, level, beta, delta, is_mode in itertools.product(
            LOSS_TYPES, ("token", "sequence"), (0.0, 0.04), (None, 1.5), (None,) + VLLM_IMPORTANCE_SAMPLING_MODES):
        if delta is not None and loss_type not in CLIPPED:
            continue  # TRL reads delta only in the clipped losses
        yield pytest.param(loss_type, level, beta, delta, is_mode,
                           id=f"{loss_type}-{level}-beta{beta}-delta{delta}-{is_mode}")


@pytest.mark.compat
@pytest.mark.parametrize("loss_type, level, beta, delta, is_mode", list(_matrix()))
def test_grpo_loss_equals_trl_compute_loss(loss_type, level, beta, delta, is_mode):
    _trl()
    config = _loss_config(loss_type, level, beta, delta)
    for kind in ("ordinary", "extreme", "offset", "empty"):
        for bias_correction in (True, False) if beta else (True,):
            config.use_bias_correction_kl = bias_correction
            trl, ours, mask = _both(config, kind, is_mode)
            _assert_equal(trl, ours, mask, f"{kind}, use_bias_correction_kl={bias_correction}")


@pytest.mark.compat
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_grpo_loss_equals_trl_with_every_other_option(loss_type, level):
    """Entropy selection, OPSM, the entropy bonus, accumulation, processes and a global count."""
    _trl()
    config = _loss_config(loss_type, level, beta=0.04, delta=1.5 if loss_type in CLIPPED else None,
                          top_entropy_quantile=0.5, off_policy_mask_threshold=0.05, entropy_coef=0.01,
                          gradient_accumulation_steps=4, steps_per_generation=2)
    for kind in ("ordinary", "extreme", "offset"):
        for seed in range(3):
            trl, ours, mask = _both(config, kind, "token_mask", clip_min=0.5, seed=seed,
                                    num_items_in_batch=37, num_processes=2)
            _assert_equal(trl, ours, mask, f"{kind}, seed {seed}")


@pytest.mark.compat
def test_the_equality_test_can_fail():
    """A compat loss with another normalizer or clip differs from TRL by far more than the tolerance."""
    _trl()
    config = _loss_config("grpo")
    trl, ours, mask = _both(config, "ordinary")
    config.loss_type = "bnpo"
    other, _, _ = _both(config, "ordinary")
    with pytest.raises(AssertionError):
        _assert_equal(trl, (other[0], other[1], ours[2]), mask, "bnpo vs grpo")
    config = _loss_config("dapo", epsilon=0.1)
    _, tighter, _ = _both(config, "ordinary")
    trl, _, _ = _both(_loss_config("dapo"), "ordinary")
    with pytest.raises(AssertionError):
        _close(tighter[0], trl[0], "epsilon 0.1 vs 0.2")


# --- the importance-sampling ratio ------------------------------------------------------------

@pytest.mark.compat
@pytest.mark.parametrize("mode", VLLM_IMPORTANCE_SAMPLING_MODES)
@pytest.mark.parametrize("clip_min", [None, 0.5])
@pytest.mark.parametrize("kind", ["ordinary", "extreme", "empty", "unscored"])
def test_vllm_importance_sampling_ratio_equals_trl(mode, clip_min, kind):
    _trl()
    _, old, _, sampling, _, mask, _ = _inputs("ordinary" if kind == "unscored" else kind)
    if kind == "unscored":  # tokens the engine could not score: NaN, inside and outside the mask
        sampling = sampling.clone()
        sampling[0, 1] = sampling[3, 0] = sampling[2, 4] = math.nan
    expected, metrics_t = trl_importance_sampling(old, sampling, mask, mode, clip_min, 3.0)
    ratio, metrics = vllm_importance_sampling_ratio(old, sampling, mask, vllm_importance_sampling_mode=mode,
                                                    vllm_importance_sampling_clip_min=clip_min)
    assert ratio.shape == expected.shape
    _close(ratio, expected, f"{mode} ratio")
    assert set(metrics) == set(metrics_t)
    for name, value in metrics_t.items():
        _close(metrics[name], value, name)


# --- where compat keeps torchforge's contract instead of TRL's --------------------------------

@pytest.mark.compat
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_nan_outside_the_mask_leaks_into_trl_but_not_here(loss_type):
    """TRL multiplies by the mask (NaN * 0 = NaN); compat's loss is TRL's on the clean input."""
    _trl()
    config = _loss_config(loss_type, beta=0.04)
    lp0, old, ref, _, A, mask, entropies = _inputs("ordinary")
    nan_lp = lp0.masked_fill(~mask.bool(), math.nan)
    inputs = dict(advantages=A, completion_mask=mask, old_per_token_logps=old, ref_per_token_logps=ref,
                  num_items_in_batch=torch.tensor(float(mask.sum())))
    leaked, _ = trl_loss(config, nan_lp.clone().requires_grad_(), entropies, inputs)
    assert torch.isnan(leaked)
    clean, _ = trl_loss(config, lp0.clone(), entropies, inputs)
    lp = nan_lp.clone().requires_grad_()
    loss, _ = grpo_loss(lp, old, A, mask, ref, **loss_kwargs(config))
    loss.backward()
    _close(loss, clean, "loss with NaN outside the mask")
    assert torch.isfinite(lp.grad).all() and (lp.grad[~mask.bool()] == 0).all()


@pytest.mark.compat   # GRPOConfig's defaults
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_nan_in_every_input_outside_the_mask_reaches_nothing(loss_type, level):
    """NaN where masked in the log-probs, the old and reference log-probs, a per-token IS ratio
    and the entropies: the loss and the gradients are those of the clean inputs."""
    config = _loss_config(loss_type, level, beta=0.04, top_entropy_quantile=0.5, entropy_coef=0.01)
    lp0, old, ref, _, A, mask, entropies = _inputs("ordinary")
    is_ratio = 0.5 + torch.rand(lp0.shape, generator=torch.Generator().manual_seed(3), dtype=lp0.dtype)
    clean = (lp0, old, ref, is_ratio, entropies)
    dirty = tuple(x.masked_fill(~mask.bool(), math.nan) for x in clean)
    results = []
    for lp, old_, ref_, is_, ent in (clean, dirty):
        lp, ent = lp.clone().requires_grad_(), ent.clone().requires_grad_()
        loss, _ = grpo_loss(lp, old_, A, mask, ref_, is_, ent, **loss_kwargs(config))
        loss.backward()
        results.append((loss, lp.grad, ent.grad))
    for (got, want), what in zip(zip(results[1], results[0]), ("loss", "log-prob gradient", "entropy gradient")):
        assert torch.isfinite(got).all(), f"{what} is not finite"
        _close(got, want, what)


# --- the config readers, and bad input ------------------------------------------------------------

@pytest.mark.compat
def test_loss_kwargs_of_a_real_grpo_config(tmp_path):
    """Every name read from GRPOConfig is a keyword of grpo_loss, with TRL's default as its own."""
    trl = pytest.importorskip("trl", reason="needs trl")
    config = trl.GRPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False, loss_type="dr_grpo",
                            beta=0.04)
    kwargs = loss_kwargs(config)
    defaults = {name: p.default for name, p in inspect.signature(grpo_loss).parameters.items()
                if p.kind is p.KEYWORD_ONLY}
    assert kwargs["loss_type"] == "dr_grpo" and kwargs["beta"] == 0.04
    assert kwargs["steps_per_generation"] == config.gradient_accumulation_steps
    for field in dataclasses.fields(trl.GRPOConfig):
        if field.name in defaults and field.name not in ("loss_type", "beta", "steps_per_generation"):
            assert defaults[field.name] == field.default, field.name
    assert set(kwargs) <= set(defaults)
    is_kwargs = importance_sampling_kwargs(config)
    assert is_kwargs == {"vllm_importance_sampling_mode": "sequence_mask",
                         "vllm_importance_sampling_clip_min": None, "vllm_importance_sampling_clip_max": 3.0}
    lp, old, _, _, A, mask, _ = _inputs("ordinary")
    grpo_loss(lp, old, A, mask, lp - 0.1, **kwargs)  # every read option is accepted


def test_imports_without_trl():
    code = "import sys; sys.modules['trl'] = None; import torchforge.compat.trl; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(loss_type="ppo"), InvalidArgumentError, "loss_type is 'ppo'; expected one of 'grpo'"),
    (dict(importance_sampling_level="row"), InvalidArgumentError, "importance_sampling_level is 'row'"),
    (dict(loss_type="grpo", delta=1.1), InvalidArgumentError, "delta=1.1 must be > 1 + epsilon_high = 1.2"),
    (dict(loss_type="cispo"), InvalidArgumentError, "caps the ratio at epsilon_high itself, got 0.2"),
    (dict(beta=0.04), InvalidArgumentError, "beta=0.04 needs ref_per_token_logps"),
    (dict(top_entropy_quantile=0.2), InvalidArgumentError, "need entropies"),
    (dict(importance_sampling_level="sequence", token_advantages=True), ShapeError,
     "needs one advantage per sequence, shape (6,)"),
])
def test_bad_input(kwargs, error, message):
    lp, old, _, _, A, mask, _ = _inputs("ordinary")
    if kwargs.pop("token_advantages", False):
        A = A.unsqueeze(-1).expand(lp.shape)
    with pytest.raises(error, match="grpo_loss: .*" + message.replace("(", r"\(").replace(")", r"\)")
                       .replace("+", r"\+")):
        grpo_loss(lp, old, A, mask, **kwargs)


def test_per_token_inputs_of_another_shape_or_dtype_raise():
    """No [B, T] input broadcasts: TRL's importance_sampling_ratio is [B, T] or [B, 1]."""
    lp, old, _, sampling, A, mask, _ = _inputs("ordinary")
    B, T = lp.shape
    with pytest.raises(ShapeError, match=rf"importance_sampling_ratio has shape \({B},\); expected \({B}, {T}\)"):
        grpo_loss(lp, old, A, mask, importance_sampling_ratio=torch.ones(B, dtype=lp.dtype))
    with pytest.raises(TypeError, match="importance_sampling_ratio has dtype torch.int64"):
        grpo_loss(lp, old, A, mask, importance_sampling_ratio=torch.ones(B, T, dtype=torch.long))
    with pytest.raises(ShapeError, match=rf"sampling_per_token_logps has shape \({T},\) but per_token_logps"):
        grpo_loss(lp, old, A, mask, sampling_per_token_logps=sampling[0], off_policy_mask_threshold=0.1)
    with pytest.raises(ShapeError, match=rf"old_per_token_logps has shape \({B},\) but per_token_logps"):
        grpo_loss(lp, old[:, 0], A, mask)


def test_importance_sampling_bad_input():
    _, old, _, sampling, _, mask, _ = _inputs("ordinary")
    with pytest.raises(InvalidArgumentError, match="vllm_importance_sampling_mode is 'token'"):
        vllm_importance_sampling_ratio(old, sampling, mask, vllm_importance_sampling_mode="token")
    with pytest.raises(InvalidArgumentError, match="clip_max set and above clip_min, got clip_min=None, clip_max=None"):
        vllm_importance_sampling_ratio(old, sampling, mask, vllm_importance_sampling_clip_max=None)


def test_hand_derived_grpo_and_dr_grpo():
    """Two rows, lengths 2 and 1, ratios (1.5, 1) and (1); A = (1, -1); epsilon 0.2.

    Per-token surrogate: -min(1.5, 1.2) = -1.2, -1, and +1 for the second row.
    grpo: mean over rows of row means = ((-1.2 - 1) / 2 + 1) / 2 = -0.05;
    dr_grpo (max_completion_length 4): (-1.2 - 1 + 1) / (2 * 4) = -0.15; the clipped token
    has zero gradient, the others -A / (2 * 2) and -A / 2 / 2 (grpo)."""
    lp = torch.log(torch.tensor([[0.6, 0.3], [0.5, 0.5]])).requires_grad_()
    old = torch.log(torch.tensor([[0.4, 0.3], [0.5, 0.9]]))
    mask = torch.tensor([[1, 1], [1, 0]])
    A = torch.tensor([1.0, -1.0])
    loss, _ = grpo_loss(lp, old, A, mask, loss_type="grpo")
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(-0.05), rtol=0, atol=1e-6)
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.25], [0.5, 0.0]]), rtol=0, atol=1e-6)
    loss, _ = grpo_loss(lp, old, A, mask, loss_type="dr_grpo", max_completion_length=4)
    torch.testing.assert_close(loss, torch.tensor(-0.15), rtol=0, atol=1e-6)
