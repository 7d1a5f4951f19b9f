"""RewardModel: the scores are the classifier's own forward on the same text, in batches, on
its own dtype; a reward function like any other, in RLTrainer and from a run config."""

import json
import re

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForSequenceClassification

from torchforge.errors import InvalidArgumentError
from torchforge.loop.rewards import guard_rewards, score_rewards
from torchforge.rewards import RewardModel
from torchforge.trainer.demo import CopyDigitsReward, char_tokenizer, copy_digits_dataset, tiny_llama


def _classifier(tokenizer, *, num_labels=1, pad=True, seed=0):
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         num_labels=num_labels, pad_token_id=tokenizer.pad_token_id if pad else None)
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config).eval()
    with torch.no_grad():  # a head far from 0, so that scores differ visibly between texts
        model.score.weight.normal_(0, 2.0)
    return model


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rm")
    tokenizer = char_tokenizer()
    _classifier(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _own_forward(folder, texts, dtype=torch.float32):
    """The saved classifier on each text alone: no padding, no batching."""
    tokenizer = char_tokenizer()
    model = LlamaForSequenceClassification.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        return [float(model(**tokenizer(text, return_tensors="pt")).logits[0, 0]) for text in texts]


PROMPTS = ["12=", "12=", "345=", "9="]
COMPLETIONS = ["12", "1", "345345", ""]


def test_scores_are_the_models_own_forward_on_each_text(rm_dir):
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    expected = _own_forward(rm_dir, texts)
    assert len(set(round(e, 4) for e in expected)) == 4  # the texts score differently
    for batch_size in (1, 3, 8):  # batches of mixed lengths are right-padded
        scores = RewardModel(rm_dir, batch_size=batch_size)(prompts=PROMPTS, completions=COMPLETIONS)
        torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_a_left_padding_tokenizer_and_a_config_without_pad_id_give_the_same_scores(tmp_path):
    tokenizer = char_tokenizer()  # pads on the left, as prompts for generate need
    model = _classifier(tokenizer, pad=False)
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    with torch.no_grad():
        expected = [float(model(**tokenizer(t, return_tensors="pt")).logits[0, 0]) for t in texts]
    rm = RewardModel(model, tokenizer, batch_size=4)
    torch.testing.assert_close(torch.tensor(rm(prompts=PROMPTS, completions=COMPLETIONS)), torch.tensor(expected),
                               rtol=1e-5, atol=1e-5)
    assert model.config.pad_token_id == tokenizer.pad_token_id  # set, so the head finds the last real token


def test_dtype_device_and_no_grad(rm_dir):
    rm = RewardModel(rm_dir, dtype="bfloat16", device="cpu")
    scores = rm(prompts=PROMPTS, completions=COMPLETIONS)
    assert rm.model.dtype == torch.bfloat16 and rm.model.device.type == "cpu"
    assert not any(p.requires_grad for p in rm.model.parameters()) and not rm.model.training
    expected = _own_forward(rm_dir, [p + c for p, c in zip(PROMPTS, COMPLETIONS)], dtype=torch.bfloat16)
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), rtol=2e-2, atol=2e-2)


def test_template_chat_messages_and_max_length(rm_dir):
    rm = RewardModel(rm_dir, template="{prompt}={completion}", max_length=3)
    assert rm.texts(["12"], ["3"]) == ["12=3"]
    # max_length keeps the end of the text (the completion): "12345" scores as its last 3 tokens would
    tokenizer = char_tokenizer()
    kept = tokenizer("12=345")["input_ids"][-3:]
    model = LlamaForSequenceClassification.from_pretrained(rm_dir).eval()
    with torch.no_grad():
        expected = float(model(input_ids=torch.tensor([kept])).logits[0, 0])
    assert rm(prompts=["12"], completions=["345"]) == pytest.approx([expected], abs=1e-5)
    chat = RewardModel(rm_dir)
    chat.load().tokenizer = None
    chat.tokenizer = char_tokenizer()
    chat.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    assert chat.texts([[{"role": "user", "content": "12"}]], ["12"]) == ["12=12="]
    chat.tokenizer.chat_template = None
    with pytest.raises(InvalidArgumentError, match=r"RewardModel 'reward_model': a prompt is a list of chat "
                                                   r"messages but the reward model's tokenizer has no chat_template"):
        chat.texts([[{"role": "user", "content": "12"}]], ["12"])


def test_a_reward_function_like_any_other(rm_dir):
    rm = RewardModel(rm_dir, name="rm", weight=0.5)
    total, parts = score_rewards([rm, CopyDigitsReward()], prompts=PROMPTS, completions=COMPLETIONS,
                                 columns={"target": ["12", "12", "345", "9"]})
    expected = torch.tensor(_own_forward(rm_dir, [p + c for p, c in zip(PROMPTS, COMPLETIONS)]), dtype=torch.float64)
    torch.testing.assert_close(parts["rm"], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(total, 0.5 * expected + parts["copy_digits"], rtol=1e-5, atol=1e-5)
    guarded = guard_rewards([rm, CopyDigitsReward()], timeout=5.0, processes=1)
    assert guarded[0] is rm  # a model stays in the training process: no worker, no timeout


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_size": 0}, r"RewardModel: batch_size=0; expected an int >= 1"),
    ({"max_length": 0}, r"RewardModel: max_length=0; expected an int >= 1 or None"),
    ({"dtype": "float8"}, r"RewardModel: dtype='float8'; expected None \(as saved\), a torch.dtype or one of"),
    ({"template": "{answer}"}, r"RewardModel: template='\{answer\}' does not format with \{prompt\} and \{completion\}"),
])
def test_bad_settings_are_named(rm_dir, kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        RewardModel(rm_dir, **kwargs)


def test_not_a_reward_model_is_refused(tmp_path):
    tokenizer = char_tokenizer()
    _classifier(tokenizer, num_labels=2).save_pretrained(tmp_path / "two")
    with pytest.raises(InvalidArgumentError, match=r"RewardModel: the model has num_labels=2; expected a reward model "
                                                   r"with one label"):
        RewardModel(tmp_path / "two")
    with pytest.raises(InvalidArgumentError, match=r"RewardModel: model '.*nowhere' does not exist; expected a local"):
        RewardModel(tmp_path / "nowhere")
    with pytest.raises(InvalidArgumentError, match=r"RewardModel: a loaded model needs its tokenizer"):
        RewardModel(_classifier(tokenizer))


def _trainer_settings(tmp_path):
    return dict(max_steps=1, num_generations=2, prompts_per_step=2, max_completion_length=4, kl_coef=0.0,
                mixed_precision="fp32", gradient_checkpointing=False, progress_bar=False,
                output_dir=str(tmp_path / "run"))


def test_rltrainer_scores_its_completions_with_the_reward_model(rm_dir, tmp_path):
    from torchforge import RLConfig, RLTrainer
    from torchforge.loop import decode_completions
    from torchforge.trainer.rollouts import render_prompt

    tokenizer = char_tokenizer()
    trainer = RLTrainer(model=tiny_llama(tokenizer), tokenizer=tokenizer, config=RLConfig(**_trainer_settings(tmp_path)),
                        reward_functions=[RewardModel(rm_dir, name="rm"), CopyDigitsReward()],
                        train_dataset=copy_digits_dataset(8))
    batch, per_function = trainer.sample(0)
    completions, _ = decode_completions(tokenizer, batch)
    prompts = [render_prompt(tokenizer, row["prompt"]) for row in trainer._rows(0)[0] for _ in range(2)]
    expected = _own_forward(rm_dir, [p + c for p, c in zip(prompts, completions)])
    torch.testing.assert_close(per_function["rm"], torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    trainer.train()
    assert {"rewards/rm/mean", "rewards/rm/std", "rewards/copy_digits/mean"} <= set(trainer.history[0])


def test_torchforge_train_takes_a_reward_model_from_the_config(rm_dir, tmp_path, capsys):
    from torchforge.trainer.cli import main

    tokenizer = char_tokenizer()
    tiny_llama(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in copy_digits_dataset(8)))
    settings = {"model": str(tmp_path / "model"), "dataset": str(data),
                "reward_functions": [{"reward_model": str(rm_dir), "name": "rm", "weight": 0.5, "batch_size": 2},
                                     "torchforge.trainer.demo.CopyDigitsReward"],
                **_trainer_settings(tmp_path)}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(settings))
    assert main(["train", "--config", str(config)]) == 0
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert {"rewards/rm/mean", "rewards/copy_digits/mean"} <= set(row)
    capsys.readouterr()

    for entry, message in [
        ({"reward_model": str(tmp_path / "nowhere")}, r"reward_functions: \{reward_model: .*nowhere\}: RewardModel: "
                                                      r"model '.*nowhere' does not exist"),
        ({"reward_model": str(rm_dir), "batchsize": 2}, r"unknown setting 'batchsize'; did you mean 'batch_size'\?"),
        ({"weight": 2}, r"names 0 of \['reward_model', 'judge'\]; expected exactly one"),
    ]:
        config.write_text(yaml.safe_dump({**settings, "reward_functions": [entry], "output_dir": str(tmp_path / "r2")}))
        assert main(["train", "--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: "), err
        assert re.search(message, err), err
        assert not (tmp_path / "r2").exists()  # refused before anything ran


@pytest.mark.slow
@pytest.mark.parametrize("strategy, shard", [("ddp", False), ("fsdp", True)])
def test_on_two_processes_each_scores_its_rows_and_the_step_matches_one_process(rm_dir, tmp_path, strategy, shard):
    # sampling is seeded per sample, so both runs score the same completions; the logged
    # mean over the processes must be the one process's mean (each process scored its own rows)
    import os
    import subprocess
    import sys

    tokenizer = char_tokenizer()
    tiny_llama(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in copy_digits_dataset(8)))
    settings = {"model": str(tmp_path / "model"), "dataset": str(data), **_trainer_settings(tmp_path),
                "prompts_per_step": 4, "max_steps": 2, "distributed_strategy": strategy,
                "reward_functions": [{"reward_model": str(rm_dir), "name": "rm", "batch_size": 3, "shard": shard}]}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(settings))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    rows = {}
    for nproc in (1, 2):
        out_dir = tmp_path / f"run{nproc}"
        done = subprocess.run([sys.executable, "-m", "torchforge", "train", "--config", str(config), "--nproc",
                               str(nproc), f"output_dir={out_dir}"], capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        rows[nproc] = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[1][0]["rewards/rm/mean"] == pytest.approx(rows[2][0]["rewards/rm/mean"], abs=1e-5)
    assert rows[1][0]["rewards/rm/std"] == pytest.approx(rows[2][0]["rewards/rm/std"], abs=1e-5)
