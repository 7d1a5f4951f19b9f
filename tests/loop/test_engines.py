"""The engine contract: HFEngine, the conformance checks (which must be able to fail), the
trainer's weight sync and its exactness guard, and the engine settings checked up front.

The vLLM engines run the same checks in tests/loop/test_vllm_engine.py (marker ``vllm``)."""

import copy
import math

import pytest
import torch

from torchforge import RLConfig, RLTrainer
from torchforge.errors import InvalidArgumentError
from torchforge.loop import Completion, HFEngine, SamplingSettings, completions_batch, rollout
from torchforge.loop.engines import check_engine_settings, make_engine, request_seeds
from torchforge.testing import check_engine, reference_log_probs
from torchforge.trainer.demo import CopyDigitsReward, char_tokenizer, copy_digits_dataset, tiny_llama


def test_hf_engine_passes_the_conformance_checks(model):
    check_engine(HFEngine(model), model)


def test_rollout_through_an_explicit_hf_engine_equals_the_default(model, tokenizer):
    kwargs = dict(num_generations=3, max_new_tokens=5, temperature=0.8, top_k=6, seed=11, prompt_ids=[4, 9])
    default = rollout(model, tokenizer, ["12=", "345="], **kwargs)
    explicit = rollout(model, tokenizer, ["12=", "345="], engine=HFEngine(model), **kwargs)
    for key in ("tokens", "mask", "prompt_tokens", "prompt_mask", "truncated", "rollout_log_probs", "policy_version"):
        assert torch.equal(default[key], explicit[key]), key


def test_rollout_log_probs_are_the_processed_distributions(model, tokenizer):
    # top-k and top-p change the distribution the trainer must compare against: the
    # engine reports log p under the filtered, tempered distribution, token by token
    settings = SamplingSettings(max_new_tokens=5, temperature=1.3, top_k=4, top_p=0.9, stop_token_ids=(2,))
    batch = rollout(model, tokenizer, ["407="], num_generations=4, max_new_tokens=5, temperature=1.3, top_k=4,
                    top_p=0.9, stop_token_ids=[2], seed=5)
    prompt = tokenizer("407=")["input_ids"]
    for row in range(4):
        n = int(batch.mask[row].sum())
        expected = reference_log_probs(model, prompt, batch.tokens[row, :n].tolist(), settings)
        torch.testing.assert_close(batch.rollout_log_probs[row, :n], expected, rtol=0, atol=1e-5)


def test_request_seeds_depend_on_the_prompt_id_and_g_only():
    both = request_seeds(3, [10, 20], 2)
    assert both[2:] == request_seeds(3, [20], 2) and both[:2] == request_seeds(3, [10], 2)
    assert len(set(both)) == 4 and request_seeds(4, [10], 2) != both[:2]


def test_completions_batch_pads_and_tags_versions():
    out = [Completion([5, 6, 2], [-0.5, -0.25, -1.0], False, 7), Completion([9], [-2.0], True, 6)]
    batch = completions_batch(out, [[1, 2], [3]], pad_id=0)
    assert batch.tokens.tolist() == [[5, 6, 2], [9, 0, 0]]
    assert batch.mask.tolist() == [[True, True, True], [True, False, False]]
    assert batch.rollout_log_probs.tolist() == [[-0.5, -0.25, -1.0], [-2.0, 0.0, 0.0]]
    assert batch.prompt_tokens.tolist() == [[1, 2], [0, 3]] and batch.prompt_mask.tolist() == [[True, True], [False, True]]
    assert batch.truncated.tolist() == [False, True] and batch.policy_version.tolist() == [7, 6]
    with pytest.raises(InvalidArgumentError, match="completion 0 has 1 tokens but 2 log_probs"):
        completions_batch([Completion([5], [-1.0, -2.0], False, 0)], [[1]], pad_id=0)


def test_rollout_refuses_an_engine_that_drops_requests(model, tokenizer):
    class Short(HFEngine):
        def generate(self, prompt_token_ids, *, seeds, settings):
            return super().generate(prompt_token_ids, seeds=seeds, settings=settings)[:-1]

    with pytest.raises(InvalidArgumentError, match="Short.generate returned 3 completions for 4 requests"):
        rollout(model, tokenizer, ["1=", "2="], num_generations=2, max_new_tokens=2, engine=Short(model))


# --- the conformance checks fail for engines that break the contract -----------------------------

class _Retokenizing(HFEngine):
    """Decodes the prompt to text and encodes it again, as a text-in engine would."""

    def generate(self, prompt_token_ids, *, seeds, settings):
        tokenizer = char_tokenizer()
        again = [tokenizer(tokenizer.decode(p, skip_special_tokens=True) or "0")["input_ids"] for p in prompt_token_ids]
        out = super().generate(again, seeds=seeds, settings=settings)
        return out


class _UnfilteredLogProbs(HFEngine):
    """Samples with top-k / top-p but reports the tempered distribution's log-probs (no filter)."""

    def generate(self, prompt_token_ids, *, seeds, settings):
        out = super().generate(prompt_token_ids, seeds=seeds, settings=settings)
        plain = SamplingSettings(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                                 stop_token_ids=settings.stop_token_ids)
        return [Completion(c.token_ids, reference_log_probs(self.model, p, c.token_ids, plain).tolist(), c.truncated,
                           c.weights_version) for p, c in zip(prompt_token_ids, out)]


class _BatchSeeded(HFEngine):
    """Seeds every request from the first one's seed and its position: samples depend on the batch."""

    def generate(self, prompt_token_ids, *, seeds, settings):
        return super().generate(prompt_token_ids, seeds=[seeds[0] + i for i in range(len(seeds))], settings=settings)


class _IgnoresWeights(HFEngine):
    """Takes the version but never loads the pushed weights."""

    def update_weights(self, weights, *, version):
        self.weights_version = version


class _RunsPastStop(HFEngine):
    """Reports every completion as cut at max_new_tokens, stop tokens inside."""

    def generate(self, prompt_token_ids, *, seeds, settings):
        long = SamplingSettings(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                                top_k=settings.top_k, top_p=settings.top_p, stop_token_ids=(10_000,))
        return super().generate(prompt_token_ids, seeds=seeds, settings=long)


@pytest.mark.parametrize("engine_cls, message", [
    (_Retokenizing, "the log-probs of request"),
    (_UnfilteredLogProbs, "top_k=5"),
    (_BatchSeeded, "in a batch and"),
    (_IgnoresWeights, "after update_weights"),
    (_RunsPastStop, "went on past stop id"),
])
def test_check_engine_catches_a_broken_engine(model, engine_cls, message):
    engine = engine_cls(copy.deepcopy(model))
    with pytest.raises(AssertionError, match=message):
        check_engine(engine, model)


# --- the trainer: weights synced into a separate engine, the gap it logs -------------------------

def _trainer(tmp_path, name, **overrides):
    tokenizer = char_tokenizer()
    config = RLConfig(max_steps=5, num_generations=4, prompts_per_step=4, max_completion_length=4, kl_coef=0.0,
                      learning_rate=2e-2, mixed_precision="fp32", gradient_checkpointing=False, progress_bar=False,
                      output_dir=str(tmp_path / name), save_steps=None, **overrides)
    return RLTrainer(model=tiny_llama(tokenizer, seed=1), tokenizer=tokenizer, config=config,
                     reward_functions=[CopyDigitsReward()], train_dataset=copy_digits_dataset(64, seed=2))


@pytest.mark.parametrize("sync_steps", [1, 0])
def test_a_separate_engine_samples_the_trained_weights_only_when_synced(tmp_path, sync_steps):
    trainer = _trainer(tmp_path, f"sync{sync_steps}", engine_sync_steps=sync_steps)
    trainer.engine = HFEngine(copy.deepcopy(trainer.model))  # a generation copy, as vLLM holds one
    trainer.train()
    gaps = [h["rollout/log_prob_gap"] for h in trainer.history]
    versions = [h["engine/weights_version"] for h in trainer.history]
    staleness = [h["rollout/staleness"] for h in trainer.history]
    if sync_steps:
        assert max(gaps) < 1e-3, gaps  # float32 noise: the engine samples what is trained
        assert versions == [1, 2, 3, 4, 5] and staleness == [0, 0, 0, 0, 0]
    else:
        assert gaps[0] < 1e-3 and min(gaps[1:]) > 1e-2, gaps  # stale from the first update on
        assert versions == [0] * 5 and staleness == [0, 1, 2, 3, 4]


def test_the_default_engine_is_the_policy_and_logs_versions(tmp_path):
    trainer = _trainer(tmp_path, "default")
    assert isinstance(trainer.engine, HFEngine) and trainer.engine.model is trainer.model
    trainer.train()
    assert [h["engine/weights_version"] for h in trainer.history] == [1, 2, 3, 4, 5]
    assert all(h["rollout/staleness"] == 0 and h["engine/sync_seconds"] == 0 for h in trainer.history)
    assert max(h["rollout/log_prob_gap"] for h in trainer.history) < 1e-3


# --- settings, checked before any model loads ----------------------------------------------------

def test_engine_settings_are_checked():
    assert check_engine_settings("hf", None) == {}
    with pytest.raises(InvalidArgumentError, match=r"engine='sglang'; expected one of \['hf', 'hf-process', 'vllm', 'vllm-server'\]"):
        RLConfig(engine="sglang")
    with pytest.raises(InvalidArgumentError, match=r"engine_args \['dtype'\] with engine='hf', which takes none"):
        RLConfig(engine_args={"dtype": "float32"})
    with pytest.raises(InvalidArgumentError, match="engine_args is 3; expected a mapping"):
        check_engine_settings("vllm", 3)
    with pytest.raises(InvalidArgumentError, match="engine_sync_steps"):
        RLConfig(engine_sync_steps=-1)


def test_a_missing_vllm_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    for engine in ("vllm", "vllm-server"):
        with pytest.raises(InvalidArgumentError, match=r"needs vLLM, which is not installed; install it with pip install -e \".\[vllm\]\""):
            RLConfig(engine=engine)


def test_make_engine_hf_samples_with_the_model(model, tokenizer):
    engine = make_engine("hf", model, tokenizer)
    assert isinstance(engine, HFEngine) and engine.model is model and engine.weights_version == 0


def test_sampling_settings_are_checked():
    for bad, message in [(dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
                         (dict(temperature=0.0), "temperature must be > 0"),
                         (dict(top_p=1.5), r"top_p must be in \(0, 1\]"), (dict(top_k=-1), "top_k must be an int >= 0"),
                         (dict(stop_token_ids=()), "stop_token_ids is empty")]:
        values = {"max_new_tokens": 2, "stop_token_ids": (2,), **bad}
        with pytest.raises(InvalidArgumentError, match=message):
            SamplingSettings(**values)
    assert not math.isnan(SamplingSettings(max_new_tokens=1, stop_token_ids=[2]).temperature)


# --- HFProcessEngine: the seeded sampler in a worker process -----------------------------------

def test_process_engine_passes_the_conformance_checks_and_equals_hf_engine(model):
    from torchforge.loop.process_engine import HFProcessEngine

    engine = HFProcessEngine(model)
    try:
        check_engine(engine, model)
        settings = SamplingSettings(max_new_tokens=5, temperature=0.9, top_k=7, stop_token_ids=(2,))
        requests, seeds = [[8, 4, 11], [9, 5]] * 3, request_seeds(3, range(6), 1)
        here = HFEngine(model).generate(requests, seeds=seeds, settings=settings)
        there = engine.generate(requests, seeds=seeds, settings=settings)
        assert [c.token_ids for c in there] == [c.token_ids for c in here]
        for a, b in zip(there, here):
            assert a.log_probs == pytest.approx(b.log_probs, abs=1e-5)
    finally:
        engine.close()
    with pytest.raises(Exception, match="the worker process is not running"):
        engine.generate([[8]], seeds=[0], settings=settings)


def test_process_engine_worker_that_dies_is_an_error_not_a_hang(model):
    from torchforge.loop.process_engine import HFProcessEngine

    engine = HFProcessEngine(model, timeout=30)
    engine._process.kill()
    engine._process.join(10)
    settings = SamplingSettings(max_new_tokens=2, stop_token_ids=(2,))
    with pytest.raises(Exception, match=r"worker process is not running \(exit code -9\)"):
        engine.generate([[8, 4]], seeds=[0], settings=settings)
    engine.close()
    with pytest.raises(InvalidArgumentError, match=r"engine_args has \['port'\], which engine='hf-process' does "
                                                   r"not take; expected some of \['threads', 'timeout'\]"):
        check_engine_settings("hf-process", {"port": 1})


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_trainer_samples_through_a_process_engine(tmp_path, asynchronous):
    # synchronous: the engine gets the weights after every step and the gap stays at float32
    # noise; asynchronous: it samples beside the trainer, within max_staleness
    changes = dict(async_generation=True, max_staleness=1) if asynchronous else {}
    trainer = _trainer(tmp_path, f"process-{asynchronous}", engine="hf-process", engine_args={"threads": 1},
                       **changes)
    try:
        trainer.train()
    finally:
        trainer.close_engine()
    assert not trainer.engine._process.is_alive()
    for h in trainer.history:
        if not asynchronous:
            assert h["engine/weights_version"] == h["step"] and h["rollout/log_prob_gap"] < 1e-5
        else:
            assert 0 <= h["async/staleness"] <= 1


def test_a_lora_sync_sends_the_changing_modules_and_the_engine_ends_equal(tmp_path):
    # LoRA on q_proj / v_proj: each sync sends only the attention modules (q, k, v, o: siblings
    # an engine may pack together), and the engine's copy ends bitwise equal to the merged weights
    pytest.importorskip("peft")
    from torchforge.trainer.lora import merged_weights

    trainer = _trainer(tmp_path, "lora", lora={"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]})
    copy_ = tiny_llama(char_tokenizer(), seed=1)
    copy_.load_state_dict(dict(merged_weights(trainer.model)))
    trainer.engine = HFEngine(copy_)
    sent = []
    update = trainer.engine.update_weights

    def recording(weights, *, version):
        weights = list(weights)
        sent.append(sorted(name for name, _ in weights))
        update(weights, version=version)

    trainer.engine.update_weights = recording
    trainer.train()
    everything = dict(merged_weights(trainer.model))
    layers = copy_.config.num_hidden_layers
    attention = sorted(f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(layers) for p in "qkvo")
    assert sent == [attention] * 5
    assert len(attention) < len(everything)
    for name, tensor in copy_.state_dict().items():
        assert torch.equal(tensor, everything[name]), name
    assert max(h["rollout/log_prob_gap"] for h in trainer.history) < 1e-5


def test_the_sync_is_skipped_when_the_engine_holds_the_version(tmp_path):
    trainer = _trainer(tmp_path, "skip")
    trainer.engine = HFEngine(copy.deepcopy(trainer.model))
    calls = []
    trainer.engine.update_weights = lambda weights, *, version: calls.append(version)
    trainer.engine.weights_version = 3
    assert trainer._sync_engine(3) == 0.0 and calls == []
    trainer._sync_engine(4)
    trainer._sync_engine(3, everything=True)  # after a checkpoint: always, whatever the version
    assert calls == [4, 3]
