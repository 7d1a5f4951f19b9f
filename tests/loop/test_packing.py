"""Padding-free forwards and token-budget micro-batches: the packed log-probs, entropies,
values and every parameter gradient equal the padded forward's, for every architecture of
tests/loop/test_architectures.py that can be packed; the others are refused with one line."""

from __future__ import annotations

import itertools
import json
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchforge.loop.packing as packing_module
import torchforge.loop.policy as policy_module
from tests.loop._arch_worker import ARCHITECTURES, VOCAB, build
from torchforge.batch import Batch
from torchforge.errors import InvalidArgumentError, ShapeError, TorchforgeError
from torchforge.loop import (
    ValueModel,
    accumulate_gradients,
    check_packable,
    completion_lengths,
    micro_batches_by_tokens,
    pack_sequences,
    policy_log_probs,
    sequence_tokens,
)
from torchforge.reduce import aggregate

# Falcon-H1's Mamba mixer carries state across positions: it cannot be packed
REFUSED = {"falcon_h1": "FalconH1Mixer"}
PACKABLE = [name for name in ARCHITECTURES if name not in REFUSED]


@pytest.fixture(autouse=True)
def _fresh_checks():
    policy_module._PATHS.clear()
    packing_module._CHECKED.clear()
    yield
    policy_module._PATHS.clear()
    packing_module._CHECKED.clear()


def ragged_batch(T: int = 7, P: int = 4, seed: int = 0) -> tuple[Batch, torch.Tensor]:
    """Completions of every length 1..T, an empty one, one with a gap in its mask (a tool's
    observation), prompts of 1..P real tokens (left-padded); and a weight per token."""
    g = torch.Generator().manual_seed(seed)
    lengths = [*range(1, T + 1), 0, T - 1]
    B = len(lengths)
    prompt_lengths = [1 + (b * 3) % P for b in range(B)]
    prompt = torch.randint(3, VOCAB, (B, P), generator=g)
    prompt_mask = torch.arange(P)[None, :] >= P - torch.tensor(prompt_lengths)[:, None]
    prompt = prompt.masked_fill(~prompt_mask, 0)
    tokens = torch.randint(3, VOCAB, (B, T), generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    tokens = tokens.masked_fill(~mask, 0)  # right padding
    mask[-1, 2:4] = False  # an observation inside the last completion: read, not counted
    batch = Batch(prompt_tokens=prompt, prompt_mask=prompt_mask, tokens=tokens, mask=mask, batch_size=[B])
    return batch, torch.randn(B, T, generator=g)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_equal(got, expected, what, rtol=1e-5):
    assert got.keys() == expected.keys(), what
    for name, ref in expected.items():
        torch.testing.assert_close(got[name], ref, rtol=rtol, atol=rtol * float(ref.abs().max()) + 1e-9,
                                   msg=lambda m, n=name: f"{what}: {n}: {m}")


def _log_probs_and_grads(model, batch, weights, *, packed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gemma3-multimodal's fallback warning (test_architectures)
        log_probs, entropy = policy_log_probs(model, batch, return_entropy=True, packed=packed)
    mask = batch.mask
    # the loss reads the counted tokens only, as every torchforge loss does
    (torch.where(mask, log_probs * weights + entropy * weights.flip(0), 0.0)).sum().backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return log_probs.detach(), entropy.detach(), grads


# --- packing itself ------------------------------------------------------------------------

def test_pack_sequences_layout_hand_case():
    # row 0: prompt [5, 6], completion [10, 11, 12]: inputs 5 6 10 11 (S = 4) at positions 0..3;
    # row 1: prompt [7, 8, 9], completion [13]: inputs 7 8 9 (S = 3), then one filler token;
    # row 2: nothing counted: left out. Token t of a row is predicted at its prompt's last
    # position + t: row 0 at 1, 2, 3; row 1 at 4 + 2 = 6.
    batch = Batch(prompt_tokens=torch.tensor([[0, 5, 6], [7, 8, 9], [1, 2, 3]]),
                  prompt_mask=torch.tensor([[False, True, True], [True, True, True], [True, True, True]]),
                  tokens=torch.tensor([[10, 11, 12], [13, 0, 0], [14, 15, 16]]),
                  mask=torch.tensor([[True, True, True], [True, False, False], [False, False, False]]),
                  batch_size=[3])
    packing = pack_sequences(batch)
    assert packing.input_ids.tolist() == [[5, 6, 10, 11], [7, 8, 9, 0]]
    assert packing.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0]]
    assert packing.gather.tolist() == [1, 2, 3, 6] and packing.targets.tolist() == [10, 11, 12, 13]
    assert packing.scatter.tolist() == [0, 1, 2, 3] and not packing.ghost
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert packing.unpack(values).tolist() == [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


def test_packing_removes_the_padding_and_keeps_each_sequence():
    batch, _ = ragged_batch()
    packing = pack_sequences(batch)
    n, L = batch.prompt_mask.sum(-1), completion_lengths(batch.mask)
    S = torch.where(L > 0, n + L - 1, 0)
    R, W = packing.input_ids.shape
    assert W == int(S.max()) and R * W < batch.prompt_tokens.shape[0] * (batch.prompt_tokens.shape[1] + 6)
    assert int(S.sum()) <= R * W and R <= 2 * int(S.sum()) / W + 1  # first-fit: one row at most half empty
    # each sequence is found again, in order, at positions 0..S-1
    flat_ids, flat_pos = packing.input_ids.view(-1), packing.position_ids.view(-1)
    starts = (flat_pos == 0).nonzero().flatten().tolist()
    found = {tuple(flat_ids[s:s + k].tolist()) for s in starts for k in S.tolist() if k and
             flat_pos[s:s + k].tolist() == list(range(k))}
    for b in range(batch.batch_size[0]):
        if L[b]:
            expected = batch.prompt_tokens[b][batch.prompt_mask[b]].tolist() + batch.tokens[b, :int(L[b]) - 1].tolist()
            assert tuple(expected) in found, b
    assert packing.targets.tolist() == batch.tokens[torch.arange(7)[None] < L[:, None]].tolist()


def test_completion_lengths_and_sequence_tokens():
    mask = torch.tensor([[True, False, True, False], [False] * 4, [True] * 4])
    assert completion_lengths(mask).tolist() == [3, 0, 4]
    batch = Batch(prompt_mask=torch.tensor([[True, True], [False, True], [False, False]]), mask=mask, batch_size=[3])
    assert sequence_tokens(batch).tolist() == [5, 1, 4]
    with pytest.raises(ShapeError, match=r"completion_lengths: mask \(4,\) torch.bool; expected a \[B, T\] bool"):
        completion_lengths(torch.ones(4, dtype=torch.bool))


def test_pack_sequences_bad_input():
    batch, _ = ragged_batch()
    with pytest.raises(ShapeError, match=r"pack_sequences: prompt_tokens \(9, 4\), prompt_mask \(9, 4\), tokens "
                                         r"\(9, 7\), mask \(9, 6\); expected \[B, P\], \[B, P\], \[B, T\], \[B, T\]"):
        pack_sequences(Batch(prompt_tokens=batch.prompt_tokens, prompt_mask=batch.prompt_mask, tokens=batch.tokens,
                             mask=batch.mask[:, :6], batch_size=[9]))
    no_prompt = batch.clone()
    no_prompt.prompt_mask[2] = False
    with pytest.raises(InvalidArgumentError, match=r"pack_sequences: row 2 has no prompt token \(prompt_mask all "
                                                   r"False\) but 3 completion tokens"):
        pack_sequences(no_prompt)


# --- exactness: every architecture ----------------------------------------------------------

@pytest.mark.parametrize("name", PACKABLE)
def test_packed_log_probs_entropy_and_gradients_equal_the_padded(name):
    model = build(name)
    batch, weights = ragged_batch()
    padded, padded_entropy, padded_grads = _log_probs_and_grads(model, batch, weights, packed=False)
    packed, packed_entropy, packed_grads = _log_probs_and_grads(model, batch, weights, packed=True)
    beyond = torch.arange(batch.tokens.shape[1])[None] >= completion_lengths(batch.mask)[:, None]
    # equal up to each row's last counted token (the gap included), 0 after it
    torch.testing.assert_close(packed[~beyond], padded[~beyond], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_entropy[~beyond], padded_entropy[~beyond], rtol=1e-5, atol=1e-5)
    assert not packed[beyond].any() and not packed_entropy[beyond].any()
    _assert_grads_equal(packed_grads, padded_grads, name)


def test_packed_value_model_values_and_gradients_equal_the_padded():
    critic = ValueModel(build("qwen3"))
    torch.nn.init.normal_(critic.head.weight, generator=torch.Generator().manual_seed(0))
    batch, weights = ragged_batch()
    out = {}
    for packed in (False, True):
        values = critic(batch, packed=packed)
        torch.where(batch.mask, values * weights, 0.0).sum().backward()
        out[packed] = values.detach(), _grads(critic)
        critic.zero_grad(set_to_none=True)
    inside = ~(torch.arange(7)[None] >= completion_lengths(batch.mask)[:, None])
    assert out[False][0].abs().max() > 0.1  # values that can differ
    torch.testing.assert_close(out[True][0][inside], out[False][0][inside], rtol=1e-5, atol=1e-6)
    assert not out[True][0][~inside].any()
    _assert_grads_equal(out[True][1], out[False][1], "critic")
    critic.packed = True  # the attribute is forward's default
    torch.testing.assert_close(critic(batch).detach(), out[True][0], rtol=0, atol=0)


def test_an_empty_batch_still_runs_a_forward_with_zero_gradients():
    # every row masked (all truncated, say): nothing to compute, but under DDP / FSDP every
    # process must run the forward and backward: zeros, connected to every parameter
    model = build("llama")
    batch, _ = ragged_batch()
    batch.mask = torch.zeros_like(batch.mask)
    log_probs, entropy = policy_log_probs(model, batch, packed=True, return_entropy=True)
    assert log_probs.shape == batch.tokens.shape and not log_probs.any() and not entropy.any()
    (log_probs.sum() + entropy.sum()).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and not g.any() for g in grads)


def test_lora_packed_equals_padded_with_and_without_adapters():
    from torchforge.trainer.lora import adapters_disabled, apply_lora

    model = apply_lora(build("llama"), {"rank": 4, "alpha": 8.0, "target_modules": "all-linear"}, seed=0)
    for _, p in model.named_parameters():  # adapters away from 0, so that they change the log-probs
        if "lora_B" in _:
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(1))
    batch, weights = ragged_batch()
    padded, _, padded_grads = _log_probs_and_grads(model, batch, weights, packed=False)
    packed, _, packed_grads = _log_probs_and_grads(model, batch, weights, packed=True)
    assert packed_grads and all("lora_" in n for n in packed_grads)
    torch.testing.assert_close(packed[batch.mask], padded[batch.mask], rtol=1e-5, atol=1e-5)
    _assert_grads_equal(packed_grads, padded_grads, "lora")
    with torch.no_grad(), adapters_disabled(model):  # the reference: the base model
        base_packed, _ = policy_log_probs(model, batch, packed=True)
        base_padded, _ = policy_log_probs(model, batch)
    torch.testing.assert_close(base_packed[batch.mask], base_padded[batch.mask], rtol=1e-5, atol=1e-5)
    assert float((base_packed - packed)[batch.mask].abs().max()) > 1e-2  # the adapters matter


def test_multi_turn_episodes_packed_equal_the_samplers_log_probs(tokenizer):
    from torchforge.loop.environments import Environment, StepResult, rollout_episodes
    from torchforge.trainer.demo import tiny_llama

    class Calculator(Environment):
        def reset(self, row):
            self.answer, self.turn = str(sum(row["terms"])), 0
            return "".join(map(str, row["terms"])) + "="

        def step(self, action):
            self.turn += 1
            if self.turn == 1:
                return StepResult(observation=self.answer + "=", reward=0.0, done=False)
            return StepResult(observation=None, reward=float(action == self.answer), done=True)

    model = tiny_llama(tokenizer, seed=2)
    rows = [{"terms": [3, 4]}, {"terms": [5, 1, 2]}]
    batch, _ = rollout_episodes(model, tokenizer, [Calculator() for _ in range(4)], rows=rows, num_generations=2,
                                max_turns=2, max_new_tokens_per_turn=4, max_total_tokens=20, seed=0)
    assert bool((~batch.mask[:, :-1] & batch.mask[:, 1:]).any())  # a gap: the tool's answer
    packed, _ = policy_log_probs(model, batch, packed=True)
    padded, _ = policy_log_probs(model, batch)
    torch.testing.assert_close(packed[batch.mask], padded[batch.mask], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed * batch.mask, batch.rollout_log_probs, rtol=1e-4, atol=1e-5)


# --- refusals ---------------------------------------------------------------------------------

def test_a_state_space_model_is_refused_with_one_line():
    model = build("falcon_h1")
    batch, _ = ragged_batch()
    message = (r"^policy_log_probs: FalconH1ForCausalLM \(model_type 'falcon_h1'\) cannot run packed sequences "
               r"\(padding_free=True\): its FalconH1Mixer layers mix tokens outside the attention mask \(state would "
               r"pass from one packed sequence to the next\); expected attention-only layers; use padding_free=False$")
    with pytest.raises(TorchforgeError, match=message):
        policy_log_probs(model, batch, packed=True)
    with pytest.raises(TorchforgeError, match=message):  # remembered: no second probe
        policy_log_probs(model, batch, packed=True)
    policy_log_probs(model, batch)  # the padded path is unaffected


def test_the_probe_catches_attention_that_crosses_sequences(monkeypatch):
    # Falcon-H1 without the layer check: the probe itself sees its Mamba state leak across
    # sequences (float32); and a Llama whose mask ignores the packed position ids leaks too
    monkeypatch.setattr(packing_module, "_stateful_layer", lambda decoder: None)
    with pytest.raises(TorchforgeError, match=r"FalconH1ForCausalLM .*on three probe sequences its packed hidden states "
                                              r"differ from the padded ones by .* tokens attend across"):
        check_packable(build("falcon_h1"))
    import transformers.masking_utils as masking

    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    with pytest.raises(TorchforgeError, match=r"^check_packable: LlamaForCausalLM \(model_type 'llama'\) cannot run "
                                              r"packed sequences .*differ from the padded ones by"):
        check_packable(build("llama"))


def test_an_attention_implementation_that_cannot_pack_is_refused():
    model = build("llama")
    model.config._attn_implementation = "paged_attention"
    with pytest.raises(TorchforgeError, match=r"check_packable: LlamaForCausalLM .* its attention implementation is "
                                              r"'paged_attention'; expected one of \['sdpa', 'eager'"):
        check_packable(model)


# --- micro-batches by tokens --------------------------------------------------------------------

def _token_batch(lengths, prompt=2):
    T = max(lengths + [1])
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    return Batch(prompt_mask=torch.ones(len(lengths), prompt, dtype=torch.bool), mask=mask, batch_size=[len(lengths)])


def test_micro_batches_by_tokens_hand_case():
    # tokens per row = 2 prompt tokens + length: 8 3 4 4 12 3 3 3; groups of 2 rows: 11, 8, 15, 6.
    # budget 16: no two neighbours fit together (19, 23, 21): 4 parts, each group alone
    batch = _token_batch([6, 1, 2, 2, 10, 1, 1, 1])
    parts = micro_batches_by_tokens(batch, 16, group_size=2)
    assert [int(sequence_tokens(p).sum()) for p in parts] == [11, 8, 15, 6]
    # budget 20: 11 + 8 = 19 | 15 | 6 -> 3 parts; of the 3-part splits (11|8|21, 11|23|6, 19|15|6)
    # this one has the least largest part
    parts = micro_batches_by_tokens(batch, 20, group_size=2)
    assert [int(sequence_tokens(p).sum()) for p in parts] == [19, 15, 6]
    # budget 25: 2 parts; of 11|29, 19|21, 34|6 the balanced one is 19|21; budget 40: one part
    assert [p.batch_size[0] for p in micro_batches_by_tokens(batch, 25, group_size=2)] == [4, 4]
    assert [p.batch_size[0] for p in micro_batches_by_tokens(batch, 40, group_size=2)] == [8]
    # a group above the budget runs alone
    assert [p.batch_size[0] for p in micro_batches_by_tokens(batch, 5, group_size=2)] == [2, 2, 2, 2]


def test_a_group_above_the_budget_does_not_let_its_neighbours_pass_the_budget():
    # rows of 3, 2, 2, 5 tokens, budget 4: the 5 runs alone, and the least limit three parts can keep
    # is 4: 3 | 2 + 2 | 5, not 3 + 2 | 2 | 5 (a limit of 5, set by the row above the budget)
    parts = micro_batches_by_tokens(_token_batch([1, 0, 0, 3]), 4)
    assert [int(sequence_tokens(p).sum()) for p in parts] == [3, 4, 5]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=12), st.integers(1, 40), st.sampled_from([1, 2, 3]))
def test_micro_batches_by_tokens_properties(lengths, budget, group_size):
    lengths = lengths + [0] * (-len(lengths) % group_size)
    batch = _token_batch(lengths)
    parts = micro_batches_by_tokens(batch, budget, group_size=group_size)
    # in order, whole groups, nothing lost
    assert all(p.batch_size[0] % group_size == 0 and p.batch_size[0] > 0 for p in parts)
    torch.testing.assert_close(torch.cat([p.mask for p in parts]), batch.mask)
    units = sequence_tokens(batch).view(-1, group_size).sum(-1).tolist()
    sizes = [int(sequence_tokens(p).sum()) for p in parts]
    # within the budget, but for a group above it alone; the fewest parts that allows
    assert all(s <= budget or p.batch_size[0] == group_size for s, p in zip(sizes, parts))
    fewest = min(k for k in range(1, len(units) + 1) for cuts in itertools.combinations(range(1, len(units)), k - 1)
                 if all(sum(units[a:b]) <= max(budget, max(units[a:b]))
                        for a, b in zip((0, *cuts), (*cuts, len(units)))))
    assert len(parts) == fewest
    # balanced: no split into as many contiguous parts has a smaller largest part
    best = min(max(sum(units[a:b]) for a, b in zip((0, *cuts), (*cuts, len(units))))
               for cuts in itertools.combinations(range(1, len(units)), len(parts) - 1))
    assert max(sizes) == best


def test_micro_batches_by_tokens_errors():
    batch = _token_batch([1, 2, 3])
    with pytest.raises(InvalidArgumentError, match=r"micro_batches_by_tokens: max_tokens=0; expected an int >= 1"):
        micro_batches_by_tokens(batch, 0)
    with pytest.raises(InvalidArgumentError, match=r"micro_batches_by_tokens: group_size=True; expected an int >= 1"):
        micro_batches_by_tokens(batch, 4, group_size=True)
    with pytest.raises(ShapeError, match=r"micro_batches_by_tokens: the batch has 3 rows, not a multiple of "
                                         r"group_size=2; expected whole groups"):
        micro_batches_by_tokens(batch, 4, group_size=2)


def test_token_budget_micro_batches_packed_give_the_whole_batch_gradient():
    # accumulate_gradients over token-budget micro-batches, each forward packed, equals one
    # padded forward of the whole batch (token-mean over the global counts)
    model = build("qwen2")
    batch, weights = ragged_batch()
    batch.advantages = weights

    def loss_fn(part, aggregation, packed=True):
        log_probs, _ = policy_log_probs(model, part, packed=packed)
        return aggregation(-part.advantages * log_probs, part.mask), {}

    parts = micro_batches_by_tokens(batch, 24)
    assert len(parts) >= 3
    loss, _ = accumulate_gradients(parts, loss_fn)
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    log_probs, _ = policy_log_probs(model, batch)
    whole = aggregate(-batch.advantages * log_probs, batch.mask)
    whole.backward()
    torch.testing.assert_close(loss, whole.detach(), rtol=1e-5, atol=0)
    _assert_grads_equal(grads, _grads(model), "token-budget micro-batches")


# --- the trainer ------------------------------------------------------------------------------

def _train(tmp_path, name, settings, nproc=()):
    from torchforge.trainer.cli import main

    common = ["max_steps=2", "prompts_per_step=4", "num_generations=4", "kl_coef=0.05", "progress_bar=false",
              "learning_rate=1e-2", "max_completion_length=6", "mask_truncated_completions=true", *settings]
    assert main(["train", *nproc, *common, f"output_dir={tmp_path / name}"]) == 0
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def _assert_runs_equal(a_runs, b_runs, keys=("loss", "reward", "kl", "grad_norm", "entropy")):
    assert len(a_runs) == len(b_runs) == 2
    for a, b in zip(a_runs, b_runs):
        assert a["grad_norm"] > 0
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)


def test_trainer_padding_free_with_a_token_budget_equals_the_padded_trainer(tmp_path):
    # from the command line: padding_free and micro_batch_tokens are RLConfig fields; PPO runs
    # the policy, the reference and the critic packed
    padded = _train(tmp_path, "padded", ["algorithm=ppo"])
    packed = _train(tmp_path, "packed", ["algorithm=ppo", "padding_free=true", "micro_batch_tokens=40"])
    _assert_runs_equal(padded, packed, keys=("loss", "reward", "kl", "grad_norm", "value_loss", "pg_loss"))


def test_two_processes_with_token_budget_micro_batches_equal_one(tmp_path):
    # FSDP2 on 2 gloo processes, packed, micro-batches by tokens (the same number on both
    # processes, whatever their lengths) against one process, padded, whole batch
    one = _train(tmp_path, "one", ["distributed_strategy=fsdp"])
    two = _train(tmp_path, "two", ["distributed_strategy=fsdp", "padding_free=true", "micro_batch_tokens=30"],
                 nproc=["--nproc", "2"])
    _assert_runs_equal(one, two)


def test_config_settings():
    from torchforge.trainer.config import RLConfig

    assert RLConfig().padding_free is False and RLConfig().micro_batch_tokens is None
    with pytest.raises(InvalidArgumentError, match=r"RLConfig: micro_batch_size=8 and micro_batch_tokens=512; "
                                                   r"expected at most one of them"):
        RLConfig(micro_batch_size=8, micro_batch_tokens=512)
    with pytest.raises(InvalidArgumentError, match=r"RLConfig: micro_batch_tokens=0; expected an int >= 1 or None"):
        RLConfig(micro_batch_tokens=0)
    with pytest.raises(InvalidArgumentError, match=r"RLConfig: padding_free='yes'; expected True or False"):
        RLConfig(padding_free="yes")


def test_trainer_refuses_a_model_that_cannot_pack_before_any_step(tmp_path):
    from torchforge.trainer.config import RLConfig
    from torchforge.trainer.demo import char_tokenizer
    from torchforge.trainer.trainer import RLTrainer

    with pytest.raises(TorchforgeError, match=r"^RLTrainer: FalconH1ForCausalLM \(model_type 'falcon_h1'\) cannot "
                                              r"run packed sequences"):
        RLTrainer(model=build("falcon_h1"), tokenizer=char_tokenizer(), reward_functions=[lambda **k: [0.0]],
                  train_dataset=[{"prompt": "12="}],
                  config=RLConfig(padding_free=True, output_dir=str(tmp_path / "x"), progress_bar=False,
                                  kl_coef=0.0, mixed_precision=None))
