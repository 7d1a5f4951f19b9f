"""Log-probs equal the model's own for every causal LM a user brings: a matrix of tiny
configs (tests/loop/_arch_worker.py) whose heads are scaled so that the logits reach 20-40
nats, where a skipped head transform (Gemma's soft cap, Granite's and Cohere's scales)
costs several nats per token."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torchforge.loop.policy as policy_module
from tests.loop._arch_worker import ARCHITECTURES, build, global_batch, launch
from torchforge.errors import ShapeError, TorchforgeError
from torchforge.log_probs import fused_token_log_probs
from torchforge.loop import (
    head_transform,
    policy_log_probs,
    rollout,
    rollout_log_prob_gap,
)

# (logit_scale, softcap) as each architecture's forward applies them (transformers 5.x)
EXPECTED_TRANSFORMS = {
    "llama": (None, None), "llama-tied": (None, None), "qwen2": (None, None), "qwen3": (None, None),
    "mistral": (None, None), "phi3": (None, None), "olmo2": (None, None), "gpt2": (None, None),
    "gemma2": (None, 30.0), "gemma3": (None, 30.0),
    "granite": (0.25, None),  # logits / logits_scaling (4)
    "cohere": (0.25, None), "cohere2": (0.25, None),  # logits * logit_scale
    "falcon_h1": (0.5, None),  # logits * lm_head_multiplier
    "minicpm3": (0.25, None),  # lm_head(hidden / (hidden_size / dim_model_base))
    "hyperclovax": (0.25, None),  # logits * logits_scaling
    "gemma3-multimodal": (None, 30.0),  # read from the text config (the forward skips it: see below)
}


def _model_log_probs(model, batch, temperature=1.0):
    """log_softmax of the model's own full logits, gathered: the obviously correct way."""
    ids = torch.cat([batch.prompt_tokens, batch.tokens], 1)
    attention = torch.cat([batch.prompt_mask, torch.ones_like(batch.tokens, dtype=torch.bool)], 1)
    positions = (attention.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention.long(), position_ids=positions).logits
    log_p = (logits[:, batch.prompt_tokens.shape[1] - 1:-1].float() / temperature).log_softmax(-1)
    return log_p.gather(-1, batch.tokens[..., None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1), logits


def _assert_grads_close(model, expected, what):
    for name, p in model.named_parameters():
        if p.grad is None and expected.get(name) is None:
            continue
        ref = expected[name]
        torch.testing.assert_close(p.grad, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()) + 1e-7,
                                   msg=lambda m, n=name: f"{what}: {n}: {m}")


@pytest.fixture(autouse=True)
def _fresh_choice():
    policy_module._PATHS.clear()
    yield
    policy_module._PATHS.clear()


def test_head_transform_reads_every_architecture():
    for name in ARCHITECTURES:
        assert head_transform(build(name)) == EXPECTED_TRANSFORMS[name], name
    assert head_transform(nn.Linear(2, 2)) == (None, None)  # no config: no transform


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_log_probs_entropy_and_gradients_equal_the_models_own(name):
    model = build(name)
    batch, weights = global_batch()
    temperature = 0.7 if name in ("gemma2", "granite") else 1.0  # the transform, then the temperature
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the read transform is right: no fallback, no warning
        if name == "gemma3-multimodal":
            warnings.simplefilter("ignore")  # see test_gemma3_multimodal_skips_the_cap
        log_probs, entropy = policy_log_probs(model, batch, temperature=temperature, return_entropy=True)
    entropy_weights = weights.flip(0)
    (log_probs * weights + entropy * entropy_weights).sum().backward()  # an entropy bonus too
    fused_grads = {n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    expected, expected_entropy, logits = _model_log_probs(model, batch, temperature)
    (expected * weights + expected_entropy * entropy_weights).sum().backward()

    assert 20 <= float(logits.detach().abs().max()) <= 80, "the logits must reach realistic magnitudes"
    torch.testing.assert_close(log_probs, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(entropy, expected_entropy.detach(), rtol=1e-4, atol=1e-4)
    for n, p in model.named_parameters():  # every parameter the model's own log-probs reach
        p.grad, ref = fused_grads[n], p.grad
        if ref is not None:
            torch.testing.assert_close(p.grad, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()) + 1e-7,
                                       msg=lambda m, n=n: f"{name}: {n}: {m}")


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_rollout_log_probs_equal_policy_log_probs(name, tokenizer):
    model = build(name)
    batch = rollout(model, tokenizer, ["12=", "7="], num_generations=2, max_new_tokens=4, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        log_probs, _ = policy_log_probs(model, batch)
    torch.testing.assert_close(batch.rollout_log_probs, log_probs.detach() * batch.mask, rtol=1e-4, atol=1e-4)
    gap = rollout_log_prob_gap(log_probs, batch.rollout_log_probs, batch.mask)
    assert float(gap["rollout/log_prob_gap"]) < 1e-4 and abs(float(gap["rollout/kl"])) < 1e-6


def test_gemma3_multimodal_skips_the_cap():
    # Gemma3ForConditionalGeneration's forward (transformers 5.x) returns the head's logits
    # without the text config's final_logit_softcapping: the check finds the transform
    # that matches the model's own output, warns once, and keeps the fused kernel.
    model = build("gemma3-multimodal")
    batch, _ = global_batch()
    with pytest.warns(RuntimeWarning, match=r"Gemma3ForConditionalGeneration .*softcap=30.0.* differ .* "
                                            r"with the fused kernel and logit_scale=None, softcap=None"):
        log_probs, _ = policy_log_probs(model, batch)
    assert policy_module._PATHS[model] == ("fused", None, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model
        again, _ = policy_log_probs(model, batch)
    expected, _, _ = _model_log_probs(model, batch)
    torch.testing.assert_close(log_probs, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, expected, rtol=1e-4, atol=1e-4)


class ScaledHead(nn.Linear):
    """A custom head that scales its logits inside its own forward: unreadable by the kernel."""

    def forward(self, x):
        return super().forward(x) * 0.5


def test_custom_head_falls_back_to_the_head_module_with_one_warning():
    model = build("llama")
    old = model.lm_head
    model.lm_head = ScaledHead(old.in_features, old.out_features, bias=False)
    model.lm_head.weight = nn.Parameter(old.weight.detach() * 2.5)
    batch, weights = global_batch()
    with pytest.warns(RuntimeWarning, match=r"LlamaForCausalLM .*its head is a ScaledHead.*through its head module"):
        log_probs, entropy = policy_log_probs(model, batch, return_entropy=True, chunk_size=3)
    assert policy_module._PATHS[model][0] == "head"
    (log_probs * weights + entropy * weights.flip(0)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    expected, expected_entropy, logits = _model_log_probs(model, batch)
    assert float(logits.detach().abs().max()) >= 20
    (expected * weights + expected_entropy * weights.flip(0)).sum().backward()
    torch.testing.assert_close(log_probs, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(entropy, expected_entropy.detach(), rtol=1e-4, atol=1e-4)
    _assert_grads_close(model, grads, "custom head")


def test_a_transform_torchforge_cannot_read_raises(monkeypatch):
    # as before this check existed: Gemma 2's soft cap not read. The fused log-probs (and
    # the head module's) are then nats away from the model's own: an error, not a silent
    # wrong answer.
    monkeypatch.setattr(policy_module, "_SOFTCAPS", ())
    model = build("gemma2")
    batch, _ = global_batch()
    assert head_transform(model) == (None, None)
    with pytest.raises(TorchforgeError, match=r"policy_log_probs: Gemma2ForCausalLM \(model_type 'gemma2'\): "
                                              r"the log-probs torchforge computes differ from the model's own"):
        policy_log_probs(model, batch)


def test_skipping_the_transform_costs_nats():
    # why the matrix scales the heads: at |z| of 20-40, the log-probs without Gemma's cap
    # or Granite's and Cohere's scales are nats away from the model's own
    for name in ("gemma2", "granite", "cohere"):
        model = build(name)
        batch, _ = global_batch()
        input_ids, attention_mask, position_ids = policy_module._model_inputs(batch)
        with torch.no_grad():
            expected, _, _ = _model_log_probs(model, batch)
            hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                         position_ids=position_ids).last_hidden_state
            skipped = fused_token_log_probs(hidden[:, batch.prompt_tokens.shape[1] - 1:], model.lm_head.weight,
                                            batch.tokens)
        assert float((skipped - expected).abs().max()) > 1.0, name


# --- the canary ----------------------------------------------------------------------------

def test_rollout_log_prob_gap_hand_case(monkeypatch):
    monkeypatch.setattr(policy_module, "_gap_warned", True)  # warned already: values only
    # diffs 0.5 and 0 -> mean |diff| 0.25; log_ratio = rollout - log_probs = (-0.5, 0):
    # k3 = exp(0.5) - 1 - 0.5 = 0.148721 and 0 -> mean 0.0743606; the masked token is ignored
    log_probs = torch.tensor([[-1.0, -2.0, -3.0]])
    rollout_log_probs = torch.tensor([[-1.5, -2.0, 9.0]])
    mask = torch.tensor([[True, True, False]])
    gap = rollout_log_prob_gap(log_probs, rollout_log_probs, mask)
    assert float(gap["rollout/log_prob_gap"]) == pytest.approx(0.25, abs=1e-7)
    assert float(gap["rollout/kl"]) == pytest.approx(0.0743606, abs=1e-6)


def test_rollout_log_prob_gap_warns_once_when_large(monkeypatch):
    monkeypatch.setattr(policy_module, "_gap_warned", False)
    log_probs, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.warns(RuntimeWarning, match=r"rollout_log_prob_gap: the trainer's log-probs differ from the "
                                            r"sampler's by 0.5 nats"):
        rollout_log_prob_gap(log_probs, log_probs - 0.5, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rollout_log_prob_gap(log_probs, log_probs - 0.5, mask)  # once
        rollout_log_prob_gap(log_probs, log_probs - 0.01, mask)  # small: never


def test_rollout_log_prob_gap_bad_shapes():
    with pytest.raises(ShapeError, match=r"rollout_log_prob_gap: log_probs \(2, 3\), rollout_log_probs \(2, 4\) "
                                         r"and mask \(2, 3\); expected three equal \[B, T\] shapes"):
        rollout_log_prob_gap(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))


# --- DDP and FSDP2 on 2 processes ----------------------------------------------------------

def test_ddp_and_fsdp2_equal_the_models_own(tmp_path):
    archs = ["llama", "gemma3"]
    launch(2, tmp_path, archs)
    for name in archs:
        results = torch.load(tmp_path / f"{name}.pt")
        model = build(name)
        batch, weights = global_batch()
        expected, _, _ = _model_log_probs(model, batch)
        (expected * weights).sum().backward()
        for strategy in ("ddp", "fsdp"):
            got = results[strategy]
            torch.testing.assert_close(got["log_probs"], expected.detach(), rtol=1e-4, atol=1e-4)
            for n, p in model.named_parameters():
                torch.testing.assert_close(got["grads"][n], p.grad, rtol=1e-4,
                                           atol=1e-4 * float(p.grad.abs().max()) + 1e-7,
                                           msg=lambda m, n=n, s=strategy, a=name: f"{a} {s}: {n}: {m}")
