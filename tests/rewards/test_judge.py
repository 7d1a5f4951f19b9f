"""LLMJudge: the judge's prompt reaches the engine as the template's tokens, its greedy answer
is parsed into the reward; a real HFEngine over a local model, in RLTrainer and from a config."""

import json

import pytest
import torch
import yaml

from torchforge.errors import InvalidArgumentError
from torchforge.loop.engines import Completion
from torchforge.rewards import LLMJudge
from torchforge.trainer.demo import CopyDigitsReward, char_tokenizer, copy_digits_dataset, tiny_llama

SEVEN = 11  # "7" in the character tokenizer (after <pad> <bos> <eos> <unk>, then "0"...)


class Recording:
    """A GenerationEngine that records its requests and answers with given token ids."""

    weights_version = 0

    def __init__(self, answers):
        self.answers, self.calls = list(answers), []

    def generate(self, prompt_token_ids, *, seeds, settings):
        self.calls.append((list(map(list, prompt_token_ids)), list(seeds), settings))
        return [Completion(self.answers.pop(0), [0.0], truncated=False, weights_version=0) for _ in prompt_token_ids]

    def update_weights(self, weights, *, version):
        pass


def test_the_engine_gets_the_template_and_the_answer_is_parsed():
    tokenizer = char_tokenizer()
    ids = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    engine = Recording([ids("7") + [2], ids("12"), [2], ids("3=4")])
    judge = LLMJudge(engine=engine, tokenizer=tokenizer, template="{prompt}{completion}={answer}",
                     max_new_tokens=3, batch_size=3)
    scores = judge(prompts=["1=", "2=", "3=", "4="], completions=["1", "22", "3", "4"], answer=["9", "8", "7", "6"])
    assert scores == [7.0, 12.0, None, 3.0]  # the first number; none -> not applicable
    (first, seeds, settings), (second, _, _) = engine.calls  # batches of 3
    assert first == [ids("1=1=9"), ids("2=22=8"), ids("3=3=7")] and second == [ids("4=4=6")]
    assert settings.top_k == 1 and settings.max_new_tokens == 3 and settings.stop_token_ids == (2,)
    assert len(set(seeds)) == 3


def test_verdict_words_and_the_unparsed_reward():
    judge = LLMJudge(engine=Recording([]), tokenizer=char_tokenizer(), template="{completion}",
                     verdicts={"Yes": 1.0, "no": 0.0}, unparsed_reward=-1.0)
    assert [judge.parse(a) for a in ("yes.", "No, yes", "nope", "I say YES")] == [1.0, 0.0, -1.0, 1.0]
    assert LLMJudge(engine=Recording([]), tokenizer=char_tokenizer()).parse("score: 8/10") == 8.0


def test_chat_template_renders_the_judge_prompt():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    judge = LLMJudge(engine=Recording([]), tokenizer=tokenizer, template="{completion}")
    assert judge.prompts(["p"], ["12"], {}) == ["12="]
    assert LLMJudge(engine=Recording([]), tokenizer=tokenizer, template="{completion}",
                    chat_template=False).prompts(["p"], ["12"], {}) == ["12"]


def _says_seven(tokenizer):
    """A tiny Llama whose greedy answer is always "7": every block adds 0 to the residual stream,
    every embedding is ones, and only the head's row for "7" is not 0."""
    model = tiny_llama(tokenizer)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[SEVEN] = 1.0
    return model


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("judge")
    tokenizer = char_tokenizer()
    _says_seven(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_local_judge_answers_through_hfengine(judge_dir):
    judge = LLMJudge(judge_dir, template="{prompt}{completion}", max_new_tokens=1, batch_size=2)
    assert judge(prompts=["1=", "22=", "333="], completions=["1", "2", ""]) == [7.0, 7.0, 7.0]
    assert type(judge.engine).__name__ == "HFEngine" and not judge.model.training
    assert LLMJudge(judge_dir, template="{completion}", max_new_tokens=2)(prompts=["1="], completions=["1"]) == [77.0]


def test_rltrainer_and_torchforge_train_take_a_judge(judge_dir, tmp_path):
    from torchforge import RLConfig, RLTrainer
    from torchforge.trainer.cli import main

    settings = dict(max_steps=1, num_generations=2, prompts_per_step=2, max_completion_length=3, kl_coef=0.0,
                    mixed_precision="fp32", gradient_checkpointing=False, progress_bar=False)
    tokenizer = char_tokenizer()
    trainer = RLTrainer(model=tiny_llama(tokenizer), tokenizer=tokenizer,
                        config=RLConfig(**settings, output_dir=str(tmp_path / "a")),
                        reward_functions=[LLMJudge(judge_dir, template="{completion}", max_new_tokens=1, weight=0.5),
                                          CopyDigitsReward()], train_dataset=copy_digits_dataset(4))
    trainer.train()
    assert trainer.history[0]["rewards/judge/mean"] == 7.0
    assert trainer.history[0]["reward"] == pytest.approx(3.5 + trainer.history[0]["rewards/copy_digits/mean"])

    tiny_llama(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in copy_digits_dataset(4)))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(tmp_path / "model"), "dataset": str(data), "output_dir": str(tmp_path / "b"), **settings,
        "reward_functions": [{"judge": str(judge_dir), "name": "grader", "template": "{prompt}{completion}",
                              "max_new_tokens": 1}]}))
    assert main(["train", "--config", str(config)]) == 0
    row = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["rewards/grader/mean"] == 7.0


@pytest.mark.parametrize("kwargs, message", [
    ({"template": "{prompt}"}, r"LLMJudge: template='\{prompt\}' has fields \['prompt'\]; expected \{completion\}"),
    ({"template": "{completion"}, r"LLMJudge: template='\{completion' is not a format string"),
    ({"max_new_tokens": 0}, r"LLMJudge: max_new_tokens=0; expected an int >= 1"),
    ({"verdicts": {}}, r"LLMJudge: verdicts=\{\}; expected a non-empty mapping of words to rewards"),
    ({"tokenizer": None}, r"LLMJudge: an engine needs the judge's tokenizer"),
])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        LLMJudge(**{"engine": Recording([]), "tokenizer": char_tokenizer(), **kwargs})


def test_a_template_column_the_samples_lack_is_named():
    judge = LLMJudge(engine=Recording([]), tokenizer=char_tokenizer(), template="{completion}{answer}")
    with pytest.raises(InvalidArgumentError, match=r"LLMJudge 'judge': the template names \['answer'\], which the "
                                                   r"samples do not have; expected dataset columns among \['target'\]"):
        judge(prompts=["p"], completions=["c"], target=["t"])
    with pytest.raises(InvalidArgumentError, match=r"LLMJudge: engine is a str; expected a GenerationEngine"):
        LLMJudge(engine="vllm", tokenizer=char_tokenizer())
    with pytest.raises(InvalidArgumentError, match=r"LLMJudge: no judge; expected a model folder"):
        LLMJudge()
