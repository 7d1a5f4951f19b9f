"""OpenEnv environments through rollout_episodes, RLTrainer and `torchforge train`, against a local server.

The server is OpenEnv's own (``create_fastapi_app`` under uvicorn) on 127.0.0.1, serving a
small game written here: the prompt is ``"12="``; each turn the reward is 1 when the model's
text starts with ``"1"``; the observation tells the turn (``"1="``); the episode is done after
two turns. The mode ``raise`` makes the step fail on the server, ``hang`` makes it answer
only after the client has given up. The server stops itself after ``SERVER_LIFETIME`` s.
"""

import json
import math
import socket
import threading
import time

import pytest

openenv_core = pytest.importorskip("openenv.core", reason="OpenEnv tests need openenv-core (torchforge[openenv])")
uvicorn = pytest.importorskip("uvicorn", reason="the OpenEnv test server needs uvicorn")

from openenv.core.env_server import Action, Observation, State, create_fastapi_app  # noqa: E402
from openenv.core.env_server import Environment as ServerEnvironment  # noqa: E402

from torchforge.errors import InvalidArgumentError  # noqa: E402
from torchforge.loop.environments import EpisodeError, rollout_episodes  # noqa: E402
from torchforge.loop.openenv import OpenEnvEnvironment, openenv_environment, text_fields  # noqa: E402
from torchforge.trainer.demo import char_tokenizer, tiny_llama  # noqa: E402

SERVER_LIFETIME = 120.0   # seconds: the server stops itself even if a test hangs
RELEASE = threading.Event()  # set at teardown: a hung step returns at once


class Reply(Action):
    message: str


class Heard(Observation):
    text: str = ""
    turn: int = 0


class TwoTurns(ServerEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, episode_id=None, mode="play", **kwargs):
        self.turn, self.mode = 0, mode
        return Heard(text="12=")

    def step(self, action, timeout_s=None, **kwargs):
        self.turn += 1
        if self.mode == "raise":
            raise ValueError("the board is on fire")
        if self.mode == "hang":
            RELEASE.wait(10.0)
        return Heard(text=f"{self.turn}=", turn=self.turn, reward=float(action.message.startswith("1")),
                     done=self.turn == 2)

    @property
    def state(self):
        return State(step_count=self.turn)


class Serving:
    """uvicorn in a daemon thread on a free port of 127.0.0.1; stops on stop() or after its lifetime."""

    def __init__(self, app, lifetime: float = SERVER_LIFETIME) -> None:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", ws="websockets-sansio"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        self.timer = threading.Timer(lifetime, self.stop)
        self.timer.daemon = True
        self.timer.start()
        for _ in range(200):  # at most 10 s
            if self.server.started:
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("the OpenEnv test server did not start in 10 s")

    def stop(self) -> None:
        self.timer.cancel()
        self.server.should_exit = True
        self.thread.join(timeout=10.0)
        self.socket.close()


@pytest.fixture(scope="module")
def server():
    RELEASE.clear()
    serving = Serving(create_fastapi_app(TwoTurns, Reply, Heard, max_concurrent_envs=64))
    yield serving
    RELEASE.set()
    serving.stop()


@pytest.fixture(scope="module")
def model():
    tokenizer = char_tokenizer()
    return tokenizer, tiny_llama(tokenizer, seed=0)


def play(model, factory, *, rows=None, G=2, **kwargs):
    tokenizer, policy = model
    rows = rows or [{"prompt": "7="}, {"prompt": "8="}]
    settings = dict(max_turns=3, max_new_tokens_per_turn=3, max_total_tokens=24, seed=0, step_timeout=10.0)
    settings.update(kwargs)
    return rollout_episodes(policy, tokenizer, [factory() for _ in range(len(rows) * G)], rows=rows,
                            num_generations=G, **settings)


def test_the_defaults_come_from_the_schema_and_the_game_is_played(server, model):
    factory = openenv_environment(server.url)
    env = factory()
    assert env.action("12") == {"message": "12"}                   # Reply's one string field
    assert env.observation({"text": "1=", "turn": 1, "done": False}) == "1="
    batch, episodes = play(model, factory)
    tokenizer = model[0]
    assert episodes.reasons == ["done"] * 4 and episodes.turns.tolist() == [2] * 4   # done passes through
    assert not episodes.faulted.any()
    for b in range(4):
        prompt = tokenizer.decode(batch.prompt_tokens[b][batch.prompt_mask[b]].tolist())
        assert prompt == "12="                                      # the reset observation is the prompt
        n = int(episodes.lengths[b])
        tokens, turn_ids, mask = batch.tokens[b, :n].tolist(), episodes.turn_index[b, :n].tolist(), batch.mask[b, :n]
        # each turn's reward: 1 when the model's text of that turn starts with "1" (the server's rule)
        model_turns = [tokenizer.decode([t for t, i in zip(tokens, turn_ids) if i == k], skip_special_tokens=True)
                       for k in range(2)]
        assert episodes.turn_rewards[b] == [float(m.startswith("1")) for m in model_turns]
        # the observation of turn 1 ("1=") sits between the two model turns, off the mask
        assert tokenizer.decode([t for t, m in zip(tokens, mask.tolist()) if not m]) == "1="


def test_a_field_name_or_a_function_maps_the_text(server, model):
    sent = []

    def to_action(text):
        sent.append(text)
        return {"message": "1" + text}                              # always rewarded

    factory = openenv_environment(server.url, action=to_action, observation=lambda fields: f"{fields['turn']}=")
    _, episodes = play(model, factory)
    assert len(sent) == 8 and [r for rs in episodes.turn_rewards for r in rs] == [1.0] * 8


@pytest.mark.parametrize("mode, settings, reason", [
    ("raise", {}, r"step raised RuntimeError: Server error: the board is on fire"),
    ("hang", {"message_timeout": 0.5}, r"step raised TimeoutError"),        # the client gives up
    ("hang", {"step_timeout": 0.5}, r"step timed out after 0.5 s"),         # the loop gives up
])
def test_a_server_that_errors_or_times_out_ends_the_episode_with_its_reason(server, model, mode, settings, reason,
                                                                          caplog):
    import re

    factory = openenv_environment(server.url, reset=lambda row: {"mode": row["mode"]},
                                  message_timeout=settings.get("message_timeout", 30.0))
    rows = [{"prompt": "1=", "mode": mode}, {"prompt": "2=", "mode": "play"}]
    begin = time.perf_counter()
    _, episodes = play(model, factory, rows=rows, fault_reward=-1.0,
                       step_timeout=settings.get("step_timeout", 10.0))
    assert time.perf_counter() - begin < 5.0                        # nobody waited for the hung server
    assert episodes.faulted.tolist() == [True, True, False, False]   # the other row played on
    assert all(re.search(reason, r) for r in episodes.reasons[:2]), episodes.reasons
    assert episodes.reasons[2:] == ["done", "done"]
    assert [rs[-1] for rs in episodes.turn_rewards[:2]] == [-1.0, -1.0] and episodes.turns[:2].tolist() == [1, 1]
    # the run goes on: the same server plays a whole step right after
    _, again = play(model, factory, rows=[{"prompt": "3=", "mode": "play"}])
    assert again.reasons == ["done", "done"]


def test_a_server_that_is_not_there(model):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{free.getsockname()[1]}"
    with pytest.raises(InvalidArgumentError, match=r"openenv_environment: could not read http://127.0.0.1:\d+/schema"):
        openenv_environment(url, connect_timeout=1.0)
    factory = openenv_environment(url, action="message", observation="text", connect_timeout=1.0)
    with pytest.raises(EpisodeError, match=r"the reset\(\) of episode 0 \(OpenEnvEnvironment\) raised ConnectionError"):
        play(model, factory)  # a reset that fails is a setup error, as for any environment


def test_a_typed_client_and_typed_actions(server, model):
    from openenv.core import EnvClient
    from openenv.core.client_types import StepResult as OpenEnvStep

    class HeardClient(EnvClient):  # what an environment's own client package looks like
        def _step_payload(self, action):
            return action.model_dump()

        def _parse_result(self, payload):
            return OpenEnvStep(observation=Heard(**payload["observation"]), reward=payload.get("reward"),
                               done=payload.get("done", False))

        def _parse_state(self, payload):
            return State(**payload)

    factory = openenv_environment(server.url, client_class=HeardClient, action=lambda text: Reply(message="1" + text),
                                  observation="text")
    _, episodes = play(model, factory)
    assert episodes.reasons == ["done"] * 4 and [r for rs in episodes.turn_rewards for r in rs] == [1.0] * 8


def test_a_server_without_a_free_session_says_so(model):
    one = Serving(create_fastapi_app(TwoTurns, Reply, Heard, max_concurrent_envs=1), lifetime=30.0)
    try:
        factory = openenv_environment(one.url)
        with pytest.raises(EpisodeError, match=r"closed the session before the reset answered .*, as a server with "
                                               r"no free session does; expected a server started with "
                                               r"max_concurrent_envs >= the episodes of a step"):
            play(model, factory, rows=[{"prompt": "1="}], G=2)
    finally:
        one.stop()


def test_an_ambiguous_schema_needs_the_mapping(server):
    schema = {"properties": {"a": {"type": "string"}, "b": {"type": "string"}, "metadata": {"type": "object"}}}
    assert text_fields(schema, {"metadata"}) == ["a", "b"]
    two = Serving(create_fastapi_app(TwoTurns, Heard.__base__, Heard, max_concurrent_envs=1), lifetime=30.0)
    try:  # the action class is the bare Action: no string field to put the text in
        with pytest.raises(InvalidArgumentError, match=r"the action schema of .* has string fields \[\]; expected "
                                                        r"exactly one for the text default, or action= naming"):
            openenv_environment(two.url)
    finally:
        two.stop()


@pytest.mark.parametrize("kwargs, message", [
    ({"base_url": "127.0.0.1:8000"}, r"OpenEnvEnvironment: base_url='127.0.0.1:8000'; expected 'http://host:port'"),
    ({"action": 3}, r"OpenEnvEnvironment: action=3; expected a field name or a function"),
    ({"message_timeout": 0}, r"OpenEnvEnvironment: message_timeout=0; expected seconds > 0"),
    ({"reset": "seed"}, r"OpenEnvEnvironment: reset='seed'; expected a function"),
])
def test_bad_settings(kwargs, message):
    settings = dict(base_url="http://127.0.0.1:1", action="message", observation="text")
    settings.update(kwargs)
    with pytest.raises(InvalidArgumentError, match=message):
        OpenEnvEnvironment(settings.pop("base_url"), **settings)


def test_through_rl_trainer(server, tmp_path):
    from torchforge.trainer.demo_episodes import multi_turn_demo_config
    from torchforge.trainer.trainer import RLTrainer

    config = multi_turn_demo_config(max_steps=1, prompts_per_step=2, num_generations=2, progress_bar=False,
                                    output_dir=str(tmp_path), save_steps=None, max_turns=3)
    trainer = RLTrainer(config=config, environment_factory=openenv_environment(server.url))
    returns = trainer.sample_step(0).episodes.returns  # step 0's episodes, sampled again by train_step (seeded)
    metrics = trainer.train_step(0)
    assert metrics["episodes/turns_mean"] == 2.0 and metrics["episodes/faulted_frac"] == 0.0
    assert metrics["rewards/environment/mean"] == pytest.approx(float(returns.mean()))
    assert math.isfinite(metrics["loss"])


def test_through_torchforge_train(server, tmp_path):
    from torchforge.trainer.cli import main

    config = tmp_path / "openenv.yaml"
    config.write_text(
        f"environment:\n  openenv: {server.url}\n  message_timeout: 10.0\n"
        "max_turns: 3\nmax_completion_length: 3\nmax_total_tokens: 16\nstep_timeout: 10.0\n"
        "num_generations: 2\nprompts_per_step: 2\nmax_steps: 2\nprogress_bar: false\nsave_steps: null\n"
        f"output_dir: {tmp_path / 'out'}\n")
    assert main(["train", "--config", str(config)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(row["episodes/turns_mean"] == 2.0 for row in rows)


def test_a_bad_openenv_block_is_one_line(tmp_path, capsys):
    from torchforge.trainer.cli import main

    assert main(["train", f"output_dir={tmp_path / 'o'}", "environment={openenv: http://127.0.0.1:1, actoin: m}"]) == 2
    assert "unknown setting environment.actoin; did you mean 'action'?" in capsys.readouterr().err


def test_without_openenv_core_the_command_says_which_extra_in_one_line(tmp_path, capsys, monkeypatch):
    import sys

    from torchforge.trainer.cli import main

    monkeypatch.setitem(sys.modules, "openenv.core", None)  # as if not installed
    assert main(["train", f"output_dir={tmp_path / 'o'}",
                 "environment={openenv: 'http://127.0.0.1:1', action: message, observation: text}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "need the openenv-core package" in err[0] and "torchforge[openenv]" in err[0]
