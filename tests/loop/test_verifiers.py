"""verifiers environments through rollout_episodes, RLTrainer and `torchforge train` (tests/loop/_verifiers_envs.py).

The rubric is checked against scores recomputed here from the model's turns as the batch
holds them, so a wrong turn order, a lost observation or a wrong weight shows.
"""

import json
import math
import re
import signal
import string

import pytest
import torch

pytest.importorskip("verifiers", reason="verifiers tests need verifiers>=0.2,<0.4 (torchforge[verifiers])")
vf = pytest.importorskip("verifiers")
if not hasattr(vf, "MultiTurnEnv"):
    pytest.skip("verifiers>=0.4 has no classic environment API", allow_module_level=True)

from tests.loop import _verifiers_envs as envs_module  # noqa: E402
from torchforge.errors import InvalidArgumentError  # noqa: E402
from torchforge.loop.environments import EpisodeError, rollout_episodes  # noqa: E402
from torchforge.loop.verifiers_env import VerifiersEnvironment, message_text  # noqa: E402
from torchforge.trainer.demo import char_tokenizer, tiny_llama  # noqa: E402

ENV_ID = "tests.loop._verifiers_envs"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def model():
    tokenizer = char_tokenizer()
    return tokenizer, tiny_llama(tokenizer, seed=0)


def play(model, source, *, N=2, G=2, **kwargs):
    tokenizer, policy = model
    rows = source.train_dataset[:N]
    episodes = [source() for _ in range(N * G)]
    settings = dict(max_turns=3, max_new_tokens_per_turn=4, max_total_tokens=20, seed=0, step_timeout=10.0)
    settings.update(kwargs)
    batch, record = rollout_episodes(policy, tokenizer, episodes, rows=rows, num_generations=G, **settings)
    return rows, episodes, batch, record


def model_turns(tokenizer, batch, record, b):
    ids = batch.tokens[b].tolist()
    index = record.turn_index[b].tolist()
    return [tokenizer.decode([t for t, k in zip(ids, index) if k == turn], skip_special_tokens=True)
            for turn in range(int(record.turns[b]))]


def expected_scores(turns, answer):
    """copied (the last turn's digits in place) and asked (turn 1 starts with '='), from the batch's tokens."""
    copied = sum(a == b for a, b in zip(turns[-1], answer)) / len(answer)
    return copied, float(turns[0].startswith("="))


def test_an_episode_is_verifiers_turns_and_its_rubric(model):
    tokenizer = model[0]
    source = VerifiersEnvironment.load(ENV_ID, chat=False)
    rows, episodes, batch, record = play(model, source, N=2, G=2)
    assert record.reasons == ["done"] * 4 and record.turns.tolist() == [2] * 4      # verifiers' max_turns=2
    rewards, parts = source.score_episodes(episodes, num_generations=2, faulted=record.faulted.tolist())
    assert set(parts) == {"copied", "asked", "num_turns"}
    for b in range(4):
        answer = rows[b // 2]["answer"]
        prompt = tokenizer.decode(batch.prompt_tokens[b][batch.prompt_mask[b]].tolist())
        assert prompt == answer + "="                                            # the row's prompt, as text
        gap = [t for t, m in zip(batch.tokens[b, :record.lengths[b]].tolist(), batch.mask[b].tolist()) if not m]
        assert tokenizer.decode(gap) == answer + "="                             # env_response's message
        copied, asked = expected_scores(model_turns(tokenizer, batch, record, b), answer)
        assert parts["copied"][b] == pytest.approx(copied) and parts["asked"][b] == asked
        assert parts["num_turns"][b] == 2.0
        assert rewards[b] == pytest.approx(0.8 * copied + 0.2 * asked)            # the rubric's weights


def test_chat_messages_go_through_the_chat_template(model):
    tokenizer = char_tokenizer(string.digits + "=\nabcdefghijklmnopqrstuvwxyz")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = TEMPLATE
    source = VerifiersEnvironment(envs_module.load_environment(), chat=True)
    rows, episodes, batch, record = play((tokenizer, tiny_llama(tokenizer, seed=0)), source, N=1, G=2,
                                         max_total_tokens=60)
    prompt = tokenizer.decode(batch.prompt_tokens[0][batch.prompt_mask[0]].tolist())
    assert prompt == f"<|im_start|>user\n{rows[0]['answer']}=<|im_end|>\n<|im_start|>assistant\n"
    assert record.turns.tolist() == [2, 2]
    for b in range(2):  # the observation: the user message, rendered by the template after the turn
        observation = [t for t, m in zip(batch.tokens[b, :record.lengths[b]].tolist(), batch.mask[b].tolist()) if not m]
        assert tokenizer.decode(observation).endswith(f"<|im_start|>user\n{rows[0]['answer']}=<|im_end|>\n"
                                                      "<|im_start|>assistant\n")


def test_the_environment_s_tools_reach_the_chat_template_in_openai_form():
    env = envs_module.load_environment()
    env.tool_defs = [vf.Tool(name="add", description="a + b", parameters={"type": "object", "properties": {}})]
    assert VerifiersEnvironment(env)().tools == [
        {"type": "function", "function": {"name": "add", "description": "a + b",
                                          "parameters": {"type": "object", "properties": {}}}}]
    assert VerifiersEnvironment(env, chat=False)().tools is None


def test_a_final_env_response_ends_the_episode(model):
    tokenizer = model[0]
    source = VerifiersEnvironment.load(ENV_ID, env_args={"mode": "final"}, chat=False)
    rows, episodes, batch, record = play(model, source, N=4, G=2)
    for b in range(8):
        first = model_turns(tokenizer, batch, record, b)[0]
        assert record.turns[b] == (2 if first.startswith("=") else 1)               # no "=": final response, done
        assert record.reasons[b] == "done"
    assert (record.turns == 1).any()                                              # the case was exercised


@pytest.mark.parametrize("mode, reason", [
    ("raise", r"step raised ValueError: the environment is broken on this row"),
    ("hang", r"step timed out after 0.5 s"),
])
def test_an_env_response_that_raises_or_hangs_ends_its_episode_and_is_not_scored(model, mode, reason):
    import time

    source = VerifiersEnvironment.load(ENV_ID, env_args={"mode": mode, "n": 32}, chat=False)
    rows = source.train_dataset
    broken = next(i for i, r in enumerate(rows) if r["answer"].startswith("1"))
    fine = next(i for i, r in enumerate(rows) if not r["answer"].startswith("1"))
    source._train_dataset = [rows[broken], rows[fine]]
    begin = time.perf_counter()
    _, episodes, batch, record = play(model, source, N=2, G=2, fault_reward=-1.0, step_timeout=0.5)
    assert time.perf_counter() - begin < 5.0
    assert record.faulted.tolist() == [True, True, False, False]
    assert all(re.fullmatch(reason, r) for r in record.reasons[:2]), record.reasons
    assert record.reasons[2:] == ["done", "done"]
    rewards, parts = source.score_episodes(episodes, num_generations=2, faulted=record.faulted.tolist())
    assert rewards[:2].tolist() == [0.0, 0.0] and parts["copied"][:2].isnan().all()   # not scored: NaN parts
    assert not parts["copied"][2:].isnan().any()


def test_group_reward_functions_see_the_episodes_of_a_row(model):
    tokenizer = model[0]
    source = VerifiersEnvironment.load(ENV_ID, env_args={"mode": "group"}, chat=False)
    rows, episodes, batch, record = play(model, source, N=2, G=4)
    rewards, parts = source.score_episodes(episodes, num_generations=4, faulted=record.faulted.tolist())
    for i in range(2):
        lasts = [len(model_turns(tokenizer, batch, record, b)[-1]) for b in range(4 * i, 4 * i + 4)]
        assert parts["longest"][4 * i:4 * i + 4].tolist() == [float(n == max(lasts)) for n in lasts]
    torch.testing.assert_close(rewards, 0.8 * parts["copied"] + 0.2 * parts["asked"] + 0.5 * parts["longest"])


def small(tmp_path, **overrides):
    from torchforge.trainer.demo_episodes import multi_turn_demo_config

    values = dict(max_steps=1, prompts_per_step=2, num_generations=2, progress_bar=False, output_dir=str(tmp_path),
                  save_steps=None, max_turns=3, max_total_tokens=20)
    values.update(overrides)
    return multi_turn_demo_config(**values)


def test_through_rl_trainer_the_rubric_is_the_reward_and_each_function_a_metric(tmp_path):
    from torchforge.trainer.trainer import RLTrainer

    source = VerifiersEnvironment(envs_module.load_environment(), chat=False, reward_weight=2.0)
    trainer = RLTrainer(config=small(tmp_path), environment_factory=source)
    assert trainer.train_dataset is source.train_dataset                          # the environment's rows
    batch, parts = trainer.sample(0)
    torch.testing.assert_close(parts["environment"], 0.8 * parts["environment/copied"]
                               + 0.2 * parts["environment/asked"])
    torch.testing.assert_close(batch.rewards.double(), 2.0 * parts["environment"])   # the reward_weight
    metrics = trainer.train_step(1)
    for name in ("copied", "asked", "num_turns"):
        assert math.isfinite(metrics[f"rewards/environment/{name}/mean"]), name
    assert metrics["rewards/environment/num_turns/mean"] == metrics["episodes/turns_mean"]


def test_through_torchforge_train(tmp_path):
    from torchforge.trainer.cli import main

    config = tmp_path / "verifiers.yaml"
    config.write_text(
        f"environment:\n  verifiers: {ENV_ID}\n  env_args: {{n: 16}}\n  chat: false\n"
        "max_turns: 3\nmax_completion_length: 4\nmax_total_tokens: 20\nstep_timeout: 10.0\n"
        "num_generations: 2\nprompts_per_step: 2\nmax_steps: 2\nprogress_bar: false\nsave_steps: null\n"
        f"output_dir: {tmp_path / 'out'}\n")
    assert main(["train", "--config", str(config)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert {"rewards/environment/copied/mean", "rewards/environment/asked/mean"} <= set(rows[0])


def test_loading_keeps_the_signal_handlers():
    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        VerifiersEnvironment.load(ENV_ID, chat=False)
        assert signal.getsignal(signal.SIGTERM) is mine                            # verifiers installs its own
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_rubric_that_hangs_is_an_error_not_a_stall(model):
    def slow(completion, **kwargs):
        import time

        time.sleep(2.0)
        return 1.0

    env = envs_module.load_environment()
    env.rubric = vf.Rubric(funcs=[slow])
    source = VerifiersEnvironment(env, chat=False, score_timeout=0.5)
    _, episodes, _, record = play(model, source, N=1, G=2)
    with pytest.raises(EpisodeError, match=r"score_episodes: the rubric of AskThenCopy did not score 2 episodes in "
                                           r"score_timeout=0.5 s"):
        source.score_episodes(episodes, num_generations=2, faulted=record.faulted.tolist())


def test_an_environment_without_a_training_dataset():
    env = vf.SingleTurnEnv(eval_dataset=envs_module.rows(2), rubric=vf.Rubric(funcs=[envs_module.asked]))
    with pytest.raises(InvalidArgumentError, match=r"VerifiersEnvironment.train_dataset: SingleTurnEnv has no "
                                                   r"training dataset"):
        VerifiersEnvironment(env).train_dataset


@pytest.mark.parametrize("make, message", [
    (lambda: VerifiersEnvironment("env"), r"VerifiersEnvironment: env is a str; expected a verifiers Environment"),
    (lambda: VerifiersEnvironment(envs_module.load_environment(), chat="no"), r"chat='no'; expected True"),
    (lambda: VerifiersEnvironment.load("no_such_environment_module"),
     r"VerifiersEnvironment.load: Could not import 'no_such_environment_module' environment"),
])
def test_bad_input(make, message):
    with pytest.raises(InvalidArgumentError, match=message):
        make()


def test_a_bad_verifiers_block_is_one_line(tmp_path, capsys):
    from torchforge.trainer.cli import main

    assert main(["train", f"output_dir={tmp_path / 'o'}", f"environment={{verifiers: {ENV_ID}, chta: false}}"]) == 2
    assert "unknown setting environment.chta; did you mean 'chat'?" in capsys.readouterr().err


def test_message_text():
    assert message_text([vf.UserMessage(content="12"), {"role": "user", "content": "="}]) == "12="


def test_without_verifiers_the_command_says_which_extra_in_one_line(tmp_path, capsys, monkeypatch):
    import sys

    from torchforge.trainer.cli import main

    monkeypatch.setitem(sys.modules, "verifiers", None)  # as if not installed
    assert main(["train", f"output_dir={tmp_path / 'o'}", f"environment={{verifiers: {ENV_ID}}}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "verifiers>=0.2,<0.4" in err[0] and "torchforge[verifiers]" in err[0]
