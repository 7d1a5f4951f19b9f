"""Multi-turn episodes: layout and masks, token in / token out, log-prob equality, limits,
faults (raising, hanging, bad values), concurrency, async steps, chat-template observations,
images in the prompt and the observations of a vision-language model, and parity across 2
processes."""

import asyncio
import logging
import string
import time

import pytest
import torch

from torchforge.errors import InvalidArgumentError
from torchforge.loop import policy_log_probs, rollout
from torchforge.loop.environments import (
    Environment,
    EpisodeError,
    StepResult,
    episode_metrics,
    rollout_episodes,
)
from torchforge.trainer.demo import char_tokenizer, tiny_llama

SEED = 5


class Scripted(Environment):
    """Observation ``"7" * turn + "="``, reward = turn number * 10 + len(action), done after ``row["turns"]``."""

    def reset(self, row):
        self.turn, self.turns, self.actions = 0, row.get("turns", 3), []
        return row["prompt"]

    def step(self, action):
        self.turn += 1
        self.actions.append(action)
        return StepResult("7" * self.turn + "=", 10.0 * self.turn + len(action), self.turn == self.turns)


def play(model, tokenizer, envs, rows, **kwargs):
    settings = dict(num_generations=len(envs) // len(rows), max_turns=4, max_new_tokens_per_turn=4,
                    max_total_tokens=40, seed=SEED)
    settings.update(kwargs)
    return rollout_episodes(model, tokenizer, envs, rows=rows, **settings)


def segments(mask_row):
    """(start, end) of each run of True, end exclusive."""
    runs, start = [], None
    for t, m in enumerate(list(mask_row) + [False]):
        if m and start is None:
            start = t
        if not m and start is not None:
            runs.append((start, t))
            start = None
    return runs


ROWS = [{"prompt": "12="}, {"prompt": "4567="}]


@pytest.fixture(scope="module")
def played(tokenizer, model):
    envs = [Scripted() for _ in range(6)]
    batch, episodes = play(model, tokenizer, envs, ROWS)
    return envs, batch, episodes


# --- layout, masks, token in / token out -------------------------------------------------

def test_layout_masks_and_rewards(tokenizer, played):
    envs, batch, episodes = played
    assert batch.batch_size == torch.Size([6]) and batch.tokens.shape == batch.mask.shape
    assert episodes.turns.tolist() == [3] * 6 and episodes.reasons == ["done"] * 6
    for b, env in enumerate(envs):
        # the G = 3 episodes of a row are contiguous: rows[b // G] went to reset
        prompt = batch.prompt_tokens[b][batch.prompt_mask[b]].tolist()
        assert prompt == tokenizer(ROWS[b // 3]["prompt"])["input_ids"]
        n = int(episodes.lengths[b])
        runs = segments(batch.mask[b].tolist())
        assert len(runs) == 3 and runs[0][0] == 0 and runs[-1][1] == n
        # between two model turns: exactly the observation's tokens, masked out
        for k, ((_, end), (start, _)) in enumerate(zip(runs, runs[1:])):
            assert batch.tokens[b, end:start].tolist() == tokenizer("7" * (k + 1) + "=")["input_ids"]
        # each action the environment saw is the decoded text of that turn's sampled tokens
        for (start, end), action in zip(runs, env.actions):
            assert tokenizer.decode(batch.tokens[b, start:end], skip_special_tokens=True) == action
        # turn k's reward at its last model token, nothing elsewhere; returns sum them
        expected = torch.zeros(batch.tokens.shape[1])
        for k, ((_, end), action) in enumerate(zip(runs, env.actions)):
            expected[end - 1] = 10.0 * (k + 1) + len(action)
        torch.testing.assert_close(batch.rewards[b], expected, rtol=0, atol=0)
        assert episodes.returns[b] == expected.sum()
        assert not batch.mask[b, n:].any() and (batch.rollout_log_probs[b][~batch.mask[b]] == 0).all()
        assert (episodes.turn_index[b][batch.mask[b]] >= 0).all() and (episodes.turn_index[b][~batch.mask[b]] == -1).all()


def test_trained_tokens_are_the_sampled_ones(tokenizer, model, played):
    """Replay every turn with a single-turn rollout of its context: the same tokens come out."""
    from torchforge.loop.environments import _turn_seed

    _, batch, _ = played
    for b in range(6):
        prompt = batch.prompt_tokens[b][batch.prompt_mask[b]].tolist()
        for k, (start, end) in enumerate(segments(batch.mask[b].tolist())):
            context = prompt + batch.tokens[b, :start].tolist()
            again = rollout(model, tokenizer, [context], num_generations=1, max_new_tokens=4,
                            seed=_turn_seed(SEED, k), prompt_ids=[b])  # episode ids: row * G + g = b here
            assert again.tokens[0][again.mask[0]].tolist() == batch.tokens[b, start:end].tolist()


def test_training_log_probs_equal_the_rollout_log_probs(model, played):
    _, batch, _ = played
    log_probs, _ = policy_log_probs(model, batch)
    torch.testing.assert_close(log_probs.detach() * batch.mask, batch.rollout_log_probs, atol=1e-5, rtol=1e-5)
    assert batch.rollout_log_probs[batch.mask].lt(0).all()


def test_gae_runs_over_the_model_tokens_only(played):
    """The gap-aware GAE on the episode batch equals GAE on the model tokens cut out of it."""
    from torchforge.returns import gae

    _, batch, _ = played
    values = torch.randn(batch.tokens.shape, generator=torch.Generator().manual_seed(0))
    advantages, _ = gae(batch.rewards, values, batch.mask, gamma=0.9, lam=0.8)
    for b in range(batch.batch_size[0]):
        m = batch.mask[b]
        compact, _ = gae(batch.rewards[b][m][None], values[b][m][None], torch.ones(1, int(m.sum()), dtype=torch.bool),
                         gamma=0.9, lam=0.8)
        torch.testing.assert_close(advantages[b][m], compact[0])


def test_episodes_do_not_depend_on_the_batch_around_them(tokenizer, model, played):
    _, batch, episodes = played
    alone, _ = play(model, tokenizer, [Scripted() for _ in range(3)], ROWS[1:], episode_ids=[1])
    n = int(episodes.lengths[4])
    assert alone.tokens[1, :n].tolist() == batch.tokens[4, :n].tolist()
    torch.testing.assert_close(alone.rollout_log_probs[1, :n], batch.rollout_log_probs[4, :n], atol=1e-5, rtol=0)


def test_per_turn_discounted_returns(tokenizer, model):
    batch, episodes = play(model, tokenizer, [Scripted()], ROWS[:1], gamma=0.5)
    r = episodes.turn_rewards[0]
    assert len(r) == 3 and episodes.returns[0].item() == pytest.approx(r[0] + 0.5 * r[1] + 0.25 * r[2])
    assert batch.rewards[0].sum().item() == pytest.approx(sum(r))


# --- limits -----------------------------------------------------------------------------------

def test_max_turns_truncates(tokenizer, model):
    batch, episodes = play(model, tokenizer, [Scripted(), Scripted()], [{"prompt": "1=", "turns": 9}], max_turns=2)
    assert episodes.turns.tolist() == [2, 2] and episodes.reasons == ["max_turns"] * 2
    assert batch.truncated.tolist() == [True, True]
    assert len(segments(batch.mask[0].tolist())) == 2   # no observation after the last turn
    assert batch.mask[0, int(episodes.lengths[0]) - 1]    # it ends on the model's last token


@pytest.mark.parametrize("limit", [3, 6, 9])
def test_max_total_tokens_truncates(tokenizer, model, limit):
    envs = [Scripted() for _ in range(4)]
    batch, episodes = play(model, tokenizer, envs, [{"prompt": "1=", "turns": 9}], max_total_tokens=limit)
    assert batch.tokens.shape[1] <= limit
    assert batch.truncated.all() and episodes.reasons == ["max_total_tokens"] * 4
    # the cut turn's action still reached step, and its reward counts
    assert [len(env.actions) for env in envs] == episodes.turns.tolist()
    assert torch.equal(episodes.returns, batch.rewards.sum(-1))


def test_the_length_limit_of_a_turn_is_not_truncation(tokenizer, model):
    batch, episodes = play(model, tokenizer, [Scripted()] * 1, ROWS[:1], max_new_tokens_per_turn=1)
    assert episodes.reasons == ["done"] and not batch.truncated.any()
    assert [e - s for s, e in segments(batch.mask[0].tolist())] == [1, 1, 1]


# --- faults ------------------------------------------------------------------------------------

class RaisesOnTurn(Scripted):
    def step(self, action):
        if self.turn == 1:
            raise ValueError("tool crashed")
        return super().step(action)


HANG = 60.0


class Hangs(Scripted):
    def step(self, action):
        if self.turn == 1:
            time.sleep(HANG)
        return super().step(action)


class HangsAsync(Scripted):
    async def step(self, action):
        if self.turn == 1:
            await asyncio.sleep(HANG)
        return super().step(action)


class BadReward(Scripted):
    def step(self, action):
        return ("=", float("nan"), False)


@pytest.mark.parametrize("bad, reason", [
    (RaisesOnTurn, "step raised ValueError: tool crashed"),
    (Hangs, "step timed out after 0.5 s"),
    (HangsAsync, "step timed out after 0.5 s"),
    (BadReward, "step returned reward nan; expected a finite float"),
])
def test_a_faulty_environment_ends_its_episode_and_the_run_goes_on(tokenizer, model, caplog, bad, reason):
    envs = [Scripted(), bad(), Scripted(), Scripted()]
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="torchforge.loop.environments"):
        batch, episodes = play(model, tokenizer, envs, [{"prompt": "1="}, {"prompt": "2="}], step_timeout=0.5,
                               fault_reward=-1.0)
    assert time.perf_counter() - start < HANG - 10   # the hung step was not waited for
    assert episodes.reasons[1] == reason and episodes.faulted.tolist() == [False, True, False, False]
    assert episodes.reasons[0] == episodes.reasons[2] == "done" and episodes.turns[[0, 2, 3]].tolist() == [3, 3, 3]
    faulty_turns = 1 if bad is BadReward else 2
    assert episodes.turns[1] == faulty_turns and episodes.turn_rewards[1][-1] == -1.0
    assert batch.rewards[1, int(episodes.lengths[1]) - 1] == -1.0 and not batch.truncated[1]
    assert any(reason in record.getMessage() and "episode 1" in record.getMessage() for record in caplog.records)
    metrics = episode_metrics(episodes.metric_sums(batch.truncated))
    assert metrics["episodes/faulted_frac"] == 0.25


def test_a_failing_reset_is_an_error(tokenizer, model):
    class NoReset(Scripted):
        def reset(self, row):
            raise KeyError("question")

    with pytest.raises(EpisodeError, match=r"rollout_episodes: the reset\(\) of episode 0 \(NoReset\) raised KeyError"):
        play(model, tokenizer, [NoReset()], ROWS[:1])


def test_environments_step_concurrently(tokenizer, model):
    class Slow(Scripted):
        def step(self, action):
            began = time.perf_counter()
            time.sleep(0.5)
            self.spans = getattr(self, "spans", []) + [(began, time.perf_counter())]
            return super().step(action)

    envs = [Slow() for _ in range(8)]
    batch, episodes = play(model, tokenizer, envs, ROWS, max_turns=2, max_total_tokens=12)
    metrics = episode_metrics(episodes.metric_sums(batch.truncated))
    assert metrics["episodes/env_seconds_per_step"] >= 0.5
    # the 8 first steps overlap in time: each began before any of them ended
    first = [env.spans[0] for env in envs]
    assert max(b for b, _ in first) < min(e for _, e in first)


def test_async_step_is_accepted(tokenizer, model, played):
    class AsyncScripted(Scripted):
        async def step(self, action):
            await asyncio.sleep(0)
            return super().step(action)

    _, batch, _ = played
    again, _ = play(model, tokenizer, [AsyncScripted() for _ in range(6)], ROWS)
    assert torch.equal(again.tokens, batch.tokens) and torch.equal(again.rewards, batch.rewards)


def test_metrics(tokenizer, model):
    batch, episodes = play(model, tokenizer, [Scripted(), Scripted()], [{"prompt": "1=", "turns": 9}], max_turns=2)
    metrics = episode_metrics(episodes.metric_sums(batch.truncated))
    assert metrics["episodes/turns_mean"] == 2.0 and metrics["episodes/truncated_frac"] == 1.0
    assert metrics["episodes/reward_per_turn"] == pytest.approx(sum(map(sum, episodes.turn_rewards)) / 4)
    assert 0 <= metrics["episodes/env_seconds_per_step"] < 0.1


# --- chat templates ----------------------------------------------------------------------------

TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat():
    tokenizer = char_tokenizer(string.ascii_lowercase + string.digits + " \n{}[]\":,=_.'")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = TEMPLATE
    return tokenizer, tiny_llama(tokenizer, seed=1)


class Calculator(Environment):
    tools = [{"name": "add", "parameters": {"a": "int", "b": "int"}}]

    def reset(self, row):
        self.turn = 0
        return [{"role": "user", "content": row["question"]}]

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return StepResult([{"role": "tool", "content": "5"}], 0.0, False)
        if self.turn == 2:
            return StepResult("plain text", 0.5, False)
        return StepResult(None, 1.0, True)


def test_chat_observations_go_through_the_template(chat):
    tokenizer, model = chat
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    batch, episodes = rollout_episodes(
        model, tokenizer, [Calculator() for _ in range(4)], rows=[{"question": "2 plus 3"}], num_generations=4,
        max_turns=3, max_new_tokens_per_turn=3, max_total_tokens=64, stop_token_ids=[end], seed=0)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt = ('<|im_start|>system\ntools: [{"name": "add", "parameters": {"a": "int", "b": "int"}}]<|im_end|>\n'
              "<|im_start|>user\n2 plus 3<|im_end|>\n<|im_start|>assistant\n")
    assert batch.prompt_tokens[0][batch.prompt_mask[0]].tolist() == encode(prompt)
    tool_turn = "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert episodes.reasons == ["done"] * 4
    for b in range(4):
        (_, end1), (start2, end2), (start3, _) = segments(batch.mask[b].tolist())
        turn1 = batch.tokens[b, :end1].tolist()
        # after the model's own <|im_end|> the template's "\n"; after a cut turn, its "<|im_end|>\n"
        glue = "\n" if turn1[-1] == end else "<|im_end|>\n"
        assert batch.tokens[b, end1:start2].tolist() == encode(glue + tool_turn)
        assert batch.tokens[b, end2:start3].tolist() == encode("plain text")   # text is appended as is
    log_probs, _ = policy_log_probs(model, batch)
    torch.testing.assert_close(log_probs.detach() * batch.mask, batch.rollout_log_probs, atol=1e-5, rtol=1e-5)


def test_messages_without_a_chat_template_are_an_error(tokenizer, model):
    with pytest.raises(InvalidArgumentError, match="rollout_episodes: a reset\\(\\) observation is a list of chat messages "
                       "but the tokenizer has no chat_template"):
        play(model, tokenizer, [Calculator()], [{"question": "1"}])


# --- images in the observations (a vision-language model) -------------------------------------------

COLOURS = ("red", "green", "blue", "yellow", "white")
# an observation's text with its image placeholder, as each family's chat template renders it
MARKUP = {"qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>", "llava": "<image>"}


def shape_image(colour):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (56, 56), "black")
    ImageDraw.Draw(image).ellipse((12, 12, 44, 44), fill=colour)
    return image


class LookAgain(Environment):
    """The row's image in the prompt; each observation shows one more image, as chat messages with
    StepResult.images, as chat parts that carry their image, or as text with the placeholder."""

    def __init__(self, style, markup="", colours=COLOURS):
        self.style, self.markup, self.colours = style, markup, colours

    def reset(self, row):
        self.turn, self.shown = 0, list(row["images"])  # every image the model sees, in order
        return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the shape ?"}]}]

    def step(self, action):
        self.turn += 1
        if self.turn == 3:
            return StepResult(None, 1.0, True)
        image = shape_image(self.colours[self.turn])
        self.shown.append(image)
        if self.style == "images":
            return StepResult([{"role": "user", "content": [{"type": "text", "text": "and"}, {"type": "image"}]}],
                              0.5, False, images=[image])
        if self.style == "parts":
            return StepResult([{"role": "user", "content": [{"type": "image", "image": image}]}], 0.5, False)
        return StepResult(f"<|im_end|><|im_start|>user {self.markup}what colour ?<|im_end|><|im_start|>assistant ",
                          0.5, False, images=[image])


@pytest.fixture(scope="module", params=[(name, scaled) for name in ("qwen2_vl", "llava") for scaled in (False, True)],
                ids=lambda p: f"{p[0]}-{'scaled' if p[1] else 'plain'}")
def vlm(request):
    pytest.importorskip("PIL", reason="images need Pillow (the vision extra)")
    from torchforge.loop.tiny_vlm import tiny_llava, tiny_qwen2_vl

    name, scaled = request.param
    model, processor = {"qwen2_vl": tiny_qwen2_vl, "llava": tiny_llava}[name](seed=1)
    if scaled:  # realistic logits (36 nats at most on an image prompt), as tests/loop/test_vision.py scales them
        text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False,
                                             add_generation_prompt=True)
        enc = processor(text=[text], images=[shape_image("red")], return_tensors="pt")
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(36.0 / float(model(**enc).logits.abs().max()))
    return name, model, processor


def play_images(model, processor, envs, rows, **kwargs):
    return rollout_episodes(model, processor.tokenizer, envs, rows=rows, num_generations=len(envs) // len(rows),
                            max_turns=4, max_new_tokens_per_turn=3, max_total_tokens=200, seed=SEED,
                            images=[row["images"] for row in rows], processor=processor, **kwargs)


def _own_log_probs(model, processor, prompt, tokens, mask, images):
    """One episode through the model's own forward, unpadded: the episode's ids (a sampled image
    placeholder, which ended its turn, as token 0), every image it saw processed in one call, in
    order; Qwen2-VL's 3D positions the model's own from mm_token_type_ids. log_softmax, gathered."""
    import inspect

    from torchforge.loop.vision import placeholder_ids

    sampled = mask & torch.isin(tokens, torch.tensor(placeholder_ids(model)))
    ids = torch.cat([prompt, tokens.masked_fill(sampled, 0)])[None]
    extra = dict(processor.image_processor(images=images, return_tensors="pt"))
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        image_pad = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
        extra["mm_token_type_ids"] = (ids == image_pad).long()
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False, **extra).logits[0]
    return logits[len(prompt) - 1:-1].float().log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)


@pytest.mark.parametrize("style", ["images", "parts", "text"])
def test_observation_images_reach_the_later_turns_and_the_log_probs_equal_the_models_own(vlm, style):
    name, model, processor = vlm
    rows = [{"images": [shape_image("red")]}, {"images": [shape_image("blue")]}]
    envs = [LookAgain(style, MARKUP[name]) for _ in range(4)]
    batch, episodes = play_images(model, processor, envs, rows)
    assert episodes.turns.tolist() == [3] * 4 and episodes.reasons == ["done"] * 4
    # the vision inputs of each episode: the prompt's image, then the two observations'
    per_image = 16 if name == "qwen2_vl" else 1  # Qwen2-VL: 16 patches of a 56 x 56 image; LLaVA: one image
    assert batch.vision["pixel_values", "length"].tolist() == [3 * per_image] * 4
    image_pad = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    with torch.no_grad():
        log_probs, _ = policy_log_probs(model, batch)
    for b, env in enumerate(envs):
        n = int(episodes.lengths[b])
        tokens, mask = batch.tokens[b, :n], batch.mask[b, :n]
        observation = tokens[~mask]
        assert int((observation == image_pad).sum()) == 2 * int((batch.prompt_tokens[b] == image_pad).sum()) > 0
        own = _own_log_probs(model, processor, batch.prompt_tokens[b][batch.prompt_mask[b]], tokens, mask, env.shown)
        torch.testing.assert_close(log_probs[b, :n] * mask, own * mask, atol=1e-5, rtol=1e-5)
        # the check can fail: the same episode read with its observations' images swapped differs
        swapped = _own_log_probs(model, processor, batch.prompt_tokens[b][batch.prompt_mask[b]], tokens, mask,
                                 [env.shown[0], env.shown[2], env.shown[1]])
        assert float(((own - swapped) * mask).abs().max()) > 1e-4
    # the sampler saw every image so far: its log-probs of the later turns are the training forward's
    torch.testing.assert_close(batch.rollout_log_probs, log_probs * batch.mask, atol=1e-5, rtol=1e-5)


def test_the_episodes_with_images_slice_into_micro_batches(vlm):
    _, model, processor = vlm
    rows = [{"images": [shape_image("red")]}, {"images": [shape_image("green")]}]
    batch, _ = play_images(model, processor, [LookAgain("images") for _ in range(4)], rows)
    with torch.no_grad():
        whole, _ = policy_log_probs(model, batch)
        for part in (slice(0, 1), slice(1, 4)):
            piece, _ = policy_log_probs(model, batch[part])
            torch.testing.assert_close(piece * batch.mask[part], whole[part] * batch.mask[part], atol=1e-5, rtol=1e-5)


class ShowsAnImage(Scripted):
    def step(self, action):
        return StepResult("7=", 0.0, False, images=[shape_image("red")])


def test_images_for_a_text_only_model_or_without_their_placeholders_are_one_line_errors(tokenizer, model, vlm):
    pytest.importorskip("PIL", reason="images need Pillow (the vision extra)")
    with pytest.raises(InvalidArgumentError, match=r"^rollout_episodes: the observation of ShowsAnImage.step \(episode 0, "
                       r"turn 0\) has 1 image\(s\) but no processor was given \(a text-only model\); expected text "
                       r"observations, or processor= with a vision-language model$"):
        play(model, tokenizer, [ShowsAnImage()], [{"prompt": "12="}])
    name, vlm_model, processor = vlm
    with pytest.raises(InvalidArgumentError, match=r"^rollout_episodes: the observation of ShowsAnImage.step \(episode 0, "
                       r"turn 0\) renders 0 image placeholder\(s\) .* but has 1 image\(s\); expected one image per "
                       r"placeholder"):
        rollout_episodes(vlm_model, processor.tokenizer, [ShowsAnImage()], rows=[{"prompt": "what colour ?"}],
                         num_generations=1, max_turns=2, max_new_tokens_per_turn=2, max_total_tokens=50,
                         processor=processor)
    with pytest.raises(InvalidArgumentError, match=r"^rollout_episodes: the reset\(\) of episode 0 \(LookAgain\) renders "
                       r"1 image placeholder\(s\) .* but has 2 image\(s\)"):
        rollout_episodes(vlm_model, processor.tokenizer, [LookAgain("images")],
                         rows=[{"images": [shape_image("red"), shape_image("blue")]}], num_generations=1, max_turns=2,
                         max_new_tokens_per_turn=2, max_total_tokens=50, images=[[shape_image("red")] * 2],
                         processor=processor)


# --- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(num_generations=2), r"rollout_episodes: 3 environments for 2 rows x num_generations=2; expected 4"),
    (dict(max_turns=0), r"rollout_episodes: max_turns must be an int >= 1, got 0"),
    (dict(max_total_tokens=2.5), r"rollout_episodes: max_total_tokens must be an int >= 1, got 2.5"),
    (dict(step_timeout=0), r"rollout_episodes: step_timeout must be > 0 or None, got 0"),
    (dict(episode_ids=[1]), r"rollout_episodes: 1 episode_ids for 2 rows; expected one each"),
])
def test_bad_input(tokenizer, model, kwargs, message):
    settings = dict(num_generations=1, max_turns=2, max_new_tokens_per_turn=2, max_total_tokens=8)
    settings.update(kwargs)
    envs = [Scripted() for _ in range(3)] if "num_generations" in kwargs else [Scripted(), Scripted()]
    with pytest.raises(InvalidArgumentError, match=message):
        rollout_episodes(model, tokenizer, envs, rows=ROWS, **settings)


# --- processes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["fsdp"])
def test_two_processes_play_the_same_episodes_as_one(tmp_path, strategy):
    """Rows split over 2 processes (which finish after different numbers of turns) give the
    episodes that one process plays with all of them."""
    from tests.loop import _episodes_worker as worker

    worker.launch(2, tmp_path / "episodes.pt", strategy)
    two = torch.load(tmp_path / "episodes.pt", weights_only=False)
    tokenizer = char_tokenizer()
    one = worker.play(tiny_llama(tokenizer, seed=3), tokenizer, list(range(worker.NUM_ROWS)))
    # rank 0's episodes end after 1 turn, rank 1's play on: the ranks' turns were kept in step
    assert [e["turns"] for e in one[:4]] == [1] * 4 and min(e["turns"] for e in one[4:]) > 1
    assert len(two) == len(one) == worker.NUM_ROWS * worker.G
    for a, b in zip(one, two):
        assert (a["tokens"], a["mask"], a["rewards"], a["reason"], a["turns"]) == \
               (b["tokens"], b["mask"], b["rewards"], b["reason"], b["turns"])
        torch.testing.assert_close(a["rollout_log_probs"], b["rollout_log_probs"], atol=1e-5, rtol=0)
