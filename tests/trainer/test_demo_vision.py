"""The embedded image task (torchforge.trainer.demo_vision): its pictures, reward and settings,
and a short run whose reward rises."""

import pytest

pytest.importorskip("PIL", reason="images need Pillow (the vision extra)")

from torchforge.loop.tiny_vlm import WORDS, tiny_qwen2_vl  # noqa: E402
from torchforge.trainer.demo_vision import (  # noqa: E402
    COLOURS,
    ShapeColourReward,
    shape_colour_dataset,
    vision_demo_config,
    write_vision_demo,
)
from torchforge.trainer.trainer import RLTrainer  # noqa: E402


def test_rows_are_seeded_and_each_picture_shows_its_colour_on_white():
    rows = shape_colour_dataset(40, seed=1)
    again = shape_colour_dataset(40, seed=1)
    assert [r["colour"] for r in rows] == [r["colour"] for r in again]
    assert all(a["images"][0].tobytes() == b["images"][0].tobytes() for a, b in zip(rows, again))
    assert set(COLOURS) <= set(WORDS) and {r["colour"] for r in rows} == set(COLOURS)
    for row in rows:
        colours = {c for _, c in row["images"][0].getcolors()}
        assert colours == {(255, 255, 255), COLOURS[row["colour"]]}  # the shape's colour only, no other


@pytest.mark.parametrize("completion, ids, expected", [
    ("red", [27, 3], 1.0),          # the colour, then the stop: 0.5 + 0.25 + 0.25
    ("red", [27, 27], 0.75),        # the colour, no stop (cut at 2 tokens)
    ("blue", [29, 3], 0.5),         # a colour word, the wrong one, and the stop
    ("the", [14, 3], 0.25),         # not a colour, but one word and the stop
    ("", [3], 0.0),                 # stopped at once: nothing named
])
def test_reward_hand_derived(completion, ids, expected):
    reward = ShapeColourReward()
    assert reward(completions=[completion], colour=["red"], completion_ids=[ids], images=[[]]) == [expected]


def test_the_reward_rises_in_a_short_run(tmp_path):
    # 30 steps: the model learns to answer with a colour word (0.625 for a random colour)
    model, processor = tiny_qwen2_vl(seed=0)
    config = vision_demo_config(max_steps=30, progress_bar=False, output_dir=str(tmp_path / "run"), save_steps=1000)
    trainer = RLTrainer(model=model, tokenizer=processor, config=config, reward_functions=[ShapeColourReward()],
                        train_dataset=shape_colour_dataset(256))
    trainer.train()
    rewards = [h["reward"] for h in trainer.history]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.3 and last > first + 0.2, rewards


def test_write_vision_demo_gives_a_run_for_the_command(tmp_path):
    import yaml

    from torchforge.trainer.cli import main

    config = write_vision_demo(tmp_path / "demo", num_rows=8)
    settings = yaml.safe_load(config.read_text())
    assert settings["reward_functions"] == ["torchforge.trainer.demo_vision.ShapeColourReward"]
    assert (tmp_path / "demo" / "images" / "00007.png").is_file()
    assert main(["train", "--config", str(config), "max_steps=1", "prompts_per_step=2", "num_generations=2",
                 "progress_bar=false"]) == 0
