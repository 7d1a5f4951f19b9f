"""Vision-language models in RLTrainer, ``torchforge train`` and ``torchforge eval``
(torchforge.trainer.vision_task): a tiny Qwen2-VL saved to a folder trains from the command
line on a JSONL of image rows and resumes, the vision tower stays frozen unless
train_vision_tower, the reward functions get PIL images, multi-turn environments show images
in their observations, evaluation scores image rows, and mistakes are one line before the
model loads."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml

pytest.importorskip("PIL", reason="images need Pillow (the vision extra)")
from PIL import Image  # noqa: E402

from torchforge.errors import InvalidArgumentError  # noqa: E402
from torchforge.loop.environments import StepResult  # noqa: E402
from torchforge.loop.tiny_vlm import save_tiny_vlm, tiny_llava, tiny_qwen2_vl  # noqa: E402
from torchforge.loop.vision import vision_tower_parameters  # noqa: E402
from torchforge.trainer.cli import main  # noqa: E402
from torchforge.trainer.config import RLConfig  # noqa: E402
from torchforge.trainer.trainer import RLTrainer  # noqa: E402
from torchforge.trainer.vision_task import chat_with_images, resolve_image_paths  # noqa: E402

COLOURS = ("red", "green", "blue", "yellow")
QUICK = dict(max_steps=2, num_generations=2, prompts_per_step=2, max_completion_length=3, progress_bar=False,
             mixed_precision=None, learning_rate=1e-2)


def colour_reward(completions, images, answer, **kwargs):
    """1 when the completion names the colour of the image's centre pixel, plus its length / 100 (so
    that a random model's groups differ and the step updates); a TRL-style function that reads
    the PIL images it is given, so a path or a missing image fails the run."""
    names = {(255, 0, 0): "red", (0, 128, 0): "green", (0, 0, 255): "blue", (255, 255, 0): "yellow"}
    out = []
    for completion, row_images, expected in zip(completions, images, answer):
        (image,) = row_images
        if not isinstance(image, Image.Image):
            raise TypeError(f"colour_reward: an image is a {type(image).__name__}; expected a PIL image")
        colour = names[image.getpixel((image.width // 2, image.height // 2))]
        assert colour == expected
        out.append(float(colour in completion) + len(completion) / 100)
    return out


def _image_rows(folder, chat: bool):
    """Rows of one solid image each, saved as PNG next to the JSONL (relative paths)."""
    rows = []
    for colour in COLOURS:
        Image.new("RGB", (56, 56), colour).save(folder / f"{colour}.png")
        question = "what colour is the image ?"
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}] if chat \
            else question
        rows.append({"prompt": prompt, "images": [f"{colour}.png"], "answer": colour})
    return rows


@pytest.fixture
def vlm_run(tmp_path):
    """A tiny Qwen2-VL folder, a JSONL of image rows (chat and string prompts), settings of a run."""
    model, processor = tiny_qwen2_vl(seed=0)
    folder = save_tiny_vlm(model, processor, str(tmp_path / "vlm"))
    data = tmp_path / "data"
    data.mkdir()
    rows = _image_rows(data, chat=True)[:2] + _image_rows(data, chat=False)[2:]
    (data / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return {"model": folder, "dataset": str(data / "rows.jsonl"), "output_dir": str(tmp_path / "out"),
            "reward_functions": ["tests.trainer.test_vision_task.colour_reward"],
            **{k: v for k, v in QUICK.items()}}


def _steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_command_trains_a_tiny_qwen2_vl_on_image_rows_and_resumes(vlm_run, tmp_path, capsys):
    from safetensors.torch import load_file

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(vlm_run))
    assert main(["train", "--config", str(config)]) == 0
    run = tmp_path / "out"
    assert "trained 2 steps (GRPO)" in capsys.readouterr().out and _steps(run) == [1, 2]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= r["rollout/log_prob_gap"] < 1e-4 for r in rows)  # the sampler saw the images the trainer saw
    # the final model: the language model trained, the vision tower as it was; the processor beside it
    before, after = load_file(f"{vlm_run['model']}/model.safetensors"), load_file(run / "final" / "model.safetensors")
    vision = [k for k in before if "visual" in k]
    assert vision and all(torch.equal(before[k], after[k]) for k in vision)
    assert any(not torch.equal(before[k], after[k]) for k in before if "visual" not in k)  # the language model
    assert (run / "final" / "processor_config.json").is_file() or (run / "final" / "preprocessor_config.json").is_file()
    # resume as for text
    assert main(["train", "--resume", "--config", str(config), "max_steps=3"]) == 0
    assert _steps(run) == [1, 2, 3]


def _trainer(tmp_path, model, processor, rows, **settings):
    config = RLConfig(**{**QUICK, "output_dir": str(tmp_path / "run"), **settings})
    return RLTrainer(model=model, tokenizer=processor, config=config, reward_functions=[colour_reward],
                     train_dataset=rows)


@pytest.mark.parametrize("build", [tiny_qwen2_vl, tiny_llava], ids=["qwen2_vl", "llava"])
def test_the_vision_tower_is_frozen_by_default_and_trains_with_train_vision_tower(tmp_path, build):
    rows = [{"prompt": "what colour is the image ?", "images": [Image.new("RGB", (56, 56), c)], "answer": c}
            for c in COLOURS]
    model, processor = build(seed=0)
    vision = set(vision_tower_parameters(model))
    trainer = _trainer(tmp_path, model, processor, rows, max_steps=1)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and not trainable & vision
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(start[n], after[n]) for n in vision)
    assert any(not torch.equal(start[n], after[n]) for n in trainable)

    model, processor = build(seed=0)
    trainer = _trainer(tmp_path / "tower", model, processor, rows, max_steps=1, train_vision_tower=True)
    assert vision <= {n for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_lora_goes_on_the_language_model_only_unless_train_vision_tower(tmp_path):
    pytest.importorskip("peft", reason="LoRA needs peft")
    rows = [{"prompt": "what colour is the image ?", "images": [Image.new("RGB", (56, 56), "red")], "answer": "red"}]
    model, processor = tiny_qwen2_vl()
    trainer = _trainer(tmp_path, model, processor, rows, lora={"rank": 2}, prompts_per_step=1)
    adapters = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n and "language_model" in n for n in adapters)
    trainer.train()  # LoRA forwards with the vision inputs (mm_token_type_ids through the peft model)
    model, processor = tiny_qwen2_vl()
    trainer = _trainer(tmp_path / "tower", model, processor, rows, lora={"rank": 2}, prompts_per_step=1,
                       train_vision_tower=True)
    assert any("lora_" in n and "visual" in n for n, p in trainer.model.named_parameters() if p.requires_grad)


def test_trainer_mistakes_are_one_line(tmp_path):
    from torchforge.trainer.demo import char_tokenizer, tiny_llama

    rows = [{"prompt": "what colour is the image ?", "images": [Image.new("RGB", (56, 56), "red")], "answer": "red"}]
    tokenizer = char_tokenizer()
    with pytest.raises(InvalidArgumentError, match=r"^RLTrainer: the train_dataset's rows have images but the model "
                                                   r"\(LlamaForCausalLM\) is text-only"):
        _trainer(tmp_path, tiny_llama(tokenizer), tokenizer, rows)
    model, processor = tiny_qwen2_vl()
    with pytest.raises(InvalidArgumentError, match=r"is a vision-language model but no processor was given"):
        _trainer(tmp_path, model, processor.tokenizer, rows)
    with pytest.raises(InvalidArgumentError, match=r"^RLTrainer: padding_free=True with a vision-language model"):
        _trainer(tmp_path, model, processor, rows, padding_free=True)
    text_rows = [{"prompt": "12=", "answer": "12"}]
    with pytest.raises(InvalidArgumentError, match=r"^RLTrainer: the eval_dataset's rows have images but the model "
                                                   r"\(LlamaForCausalLM\) is text-only"):
        RLTrainer(model=tiny_llama(tokenizer), tokenizer=tokenizer, config=RLConfig(**{
            **QUICK, "output_dir": str(tmp_path / "text"), "eval_steps": 1}), reward_functions=[colour_reward],
            train_dataset=text_rows, eval_dataset=rows)
    # what the trainer does not take images through yet (the config as RLConfig checks it, vLLM installed or not)
    from types import SimpleNamespace

    from torchforge.trainer.vision_task import vision_task

    vllm = SimpleNamespace(padding_free=False, engine="vllm")
    with pytest.raises(InvalidArgumentError, match=r"^RLTrainer: engine='vllm' with a vision-language model: only "
                                                   r"'hf' samples from images here; expected engine='hf'$"):
        vision_task(model, processor, None, rows, vllm)
    hf = SimpleNamespace(padding_free=False, engine="hf")
    with pytest.raises(InvalidArgumentError, match=r"^RLTrainer: processor is a \w+; expected the model.s processor"):
        vision_task(model, None, processor.tokenizer, rows, hf)
    tokenizer_of, task = vision_task(model, None, processor, rows, hf)  # the processor alone: its tokenizer
    assert tokenizer_of is processor.tokenizer and task.processor is processor


# --- multi-turn environments and evaluation with images -----------------------------------------

class LookTwice:
    """An episode that shows the row's image, then (after the model's first turn) a second image
    of the same colour, and rewards naming the colour at the end."""

    def reset(self, row):
        self.turn, self.colour = 0, row["answer"]
        return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the image ?"}]}]

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return StepResult([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "is there ?"}]}],
                              0.0, False, images=[Image.new("RGB", (56, 56), self.colour)])
        return StepResult(None, float(self.colour in action), True)


def test_an_environment_trains_a_vlm_with_images_in_its_observations(tmp_path):
    rows = [{"images": [Image.new("RGB", (56, 56), c)], "answer": c} for c in COLOURS]
    model, processor = tiny_qwen2_vl(seed=0)
    config = RLConfig(**{**QUICK, "output_dir": str(tmp_path / "run"), "max_turns": 3, "max_total_tokens": 64})
    trainer = RLTrainer(model=model, tokenizer=processor, config=config, reward_functions=[colour_reward],
                        train_dataset=rows, environment_factory=LookTwice)
    scored = trainer.sample_step(0)
    batch = scored.batch
    # each episode: the row's image in the prompt and the observation's after the first turn
    assert scored.episodes.turns.tolist() == [2] * batch.batch_size[0]
    assert batch.vision["image_grid_thw", "length"].tolist() == [2] * batch.batch_size[0]
    image_pad = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    assert all(int((batch.tokens[b][~batch.mask[b]] == image_pad).sum()) == 4 for b in range(batch.batch_size[0]))
    from torchforge.loop import policy_log_probs

    with torch.no_grad():
        log_probs, _ = policy_log_probs(trainer.model, batch)
    torch.testing.assert_close(log_probs * batch.mask, batch.rollout_log_probs, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(scored.per_function["colour_reward"]).all()  # colour_reward read each row's PIL image
    trainer.train()
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2] and all(r["rollout/log_prob_gap"] < 1e-4 for r in logged)


def test_the_trainer_evaluates_image_rows_as_it_trains_them(tmp_path):
    from torchforge.loop import decode_completions, rollout
    from torchforge.trainer.vision_task import row_prompt_and_images

    rows = [{"prompt": "what colour is the image ?", "images": [Image.new("RGB", (56, 56), c)], "answer": c}
            for c in COLOURS]
    seen = []

    def colour_seen(completions, images, answer, **kwargs):
        seen.append(list(completions))
        return colour_reward(completions, images, answer)

    model, processor = tiny_qwen2_vl(seed=0)
    config = RLConfig(**{**QUICK, "output_dir": str(tmp_path / "run"), "eval_steps": 1, "num_eval_generations": 2})
    trainer = RLTrainer(model=model, tokenizer=processor, config=config, reward_functions=[colour_seen],
                        train_dataset=rows, eval_dataset=rows[:3])
    metrics = trainer.evaluate()
    assert metrics["eval/num_prompts"] == 3.0
    # the sampled completions are the ones a rollout with the rows' images gives (the same seeds)
    prompts, images = zip(*(row_prompt_and_images(processor, row, "row") for row in rows[:3]))
    batch = rollout(trainer.model, processor.tokenizer, list(prompts), num_generations=2, max_new_tokens=3,
                    seed=config.seed, images=list(images), processor=processor, stop_token_ids=trainer.stop_ids)
    assert seen[0] == decode_completions(processor.tokenizer, batch)[0]
    assert metrics["eval/reward"] == pytest.approx(sum(colour_reward(seen[0], [im for im in images for _ in range(2)],
                                                                     [r["answer"] for r in rows[:3] for _ in range(2)])) / 6)


def test_torchforge_eval_scores_a_vlm_folder_on_image_rows(vlm_run, tmp_path, capsys):
    from transformers import AutoModelForImageTextToText

    from torchforge.loop.vision import load_processor
    from torchforge.trainer.evaluation import evaluate_dataset
    from torchforge.trainer.vision_task import resolve_image_paths

    out = tmp_path / "eval.json"
    assert main(["eval", "--model", vlm_run["model"], "--dataset", vlm_run["dataset"], "--reward-function",
                 vlm_run["reward_functions"][0], "--out", str(out), "num_eval_generations=2",
                 "max_completion_length=3"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text()) and printed["eval/num_prompts"] == 4.0
    # what evaluate_dataset gives on the same model, processor and rows (paths from the JSONL's folder)
    rows = resolve_image_paths([json.loads(line) for line in open(vlm_run["dataset"])], tmp_path / "data")
    direct = evaluate_dataset(AutoModelForImageTextToText.from_pretrained(vlm_run["model"]).eval(),
                              load_processor(vlm_run["model"]).tokenizer, rows, [colour_reward],
                              RLConfig(num_eval_generations=2, max_completion_length=3),
                              processor=load_processor(vlm_run["model"]))
    assert printed == pytest.approx(direct, rel=1e-6)


def test_a_lora_vlm_run_exports_its_adapters_and_merged_model_and_torchforge_eval_scores_both(vlm_run, tmp_path,
                                                                                            capsys):
    """LoRA on a VLM from the command line: final/ (the adapters and the processor) and
    final-merged/ (lora.merge) load as vision-language models; the merged model's logits
    equal the adapter model's, and torchforge eval scores both folders alike."""
    pytest.importorskip("peft", reason="LoRA needs peft")
    from transformers import AutoModelForImageTextToText

    from torchforge.trainer.lora import adapter_base_model, load_adapter_model

    settings = {**vlm_run, "max_steps": 1, "lora": {"rank": 2, "merge": True}, "learning_rate": 0.05}
    assert main(["train", *(f"{k}={json.dumps(v)}" for k, v in settings.items())]) == 0
    final, merged = tmp_path / "out" / "final", tmp_path / "out" / "final-merged"
    assert adapter_base_model(final) == vlm_run["model"] and (final / "processor_config.json").is_file()
    adapted = load_adapter_model(final)
    plain = AutoModelForImageTextToText.from_pretrained(merged).eval()
    base = AutoModelForImageTextToText.from_pretrained(vlm_run["model"]).eval()
    _, processor = tiny_qwen2_vl(seed=0)
    inputs = processor(text=["<|vision_start|><|image_pad|><|vision_end|> what colour is the image ?"],
                       images=[Image.new("RGB", (56, 56), "red")], return_tensors="pt")
    with torch.no_grad():
        logits = [m(**inputs).logits for m in (adapted, plain, base)]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    assert (logits[0] - logits[2]).abs().max() > 1e-4  # the adapters trained: not the base model
    scores = []
    for folder in (final, merged):
        capsys.readouterr()
        assert main(["eval", "--model", str(folder), "--dataset", vlm_run["dataset"], "--reward-function",
                     vlm_run["reward_functions"][0], "num_eval_generations=2", "max_completion_length=3"]) == 0
        scores.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert scores[0]["eval/num_prompts"] == 4.0 and scores[0] == pytest.approx(scores[1], rel=1e-6)


@pytest.mark.parametrize("setting", ["async_generation=true", "mixed_precision=bf16"])
def test_a_vlm_trains_with_asynchronous_generation_and_in_bf16(vlm_run, setting, capsys):
    """The generator thread's copy of the model samples from the images too (its first batch,
    sampled with the initial weights, has the trainer's log-probs); bf16 likewise."""
    assert main(["train", *(f"{k}={json.dumps(v)}" for k, v in vlm_run.items()), setting]) == 0
    rows = [json.loads(line) for line in open(f"{vlm_run['output_dir']}/metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert 0.0 <= rows[0]["rollout/log_prob_gap"] < 1e-4


def test_a_vlm_trains_on_two_processes_with_the_metrics_of_one(vlm_run, tmp_path):
    """DDP and FSDP2 (the vision tower and projector their own units: generate runs them
    before the first forward) give the single-process losses and gradient norms."""
    settings = [f"{k}={json.dumps(v)}" for k, v in vlm_run.items() if k != "output_dir"]
    runs = {}
    for name, extra in (("one", []), ("ddp", ["--nproc", "2", "distributed_strategy=ddp"]),
                        ("fsdp", ["--nproc", "2", "distributed_strategy=fsdp"])):
        assert main(["train", *extra, *settings, f"output_dir={tmp_path / name}"]) == 0, name
        runs[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    for name in ("ddp", "fsdp"):
        assert [r["step"] for r in runs[name]] == [1, 2]
        for a, b in zip(runs["one"], runs[name]):
            for key in ("loss", "reward", "grad_norm", "entropy", "completions/mean_length"):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (name, a["step"], key)


def test_an_image_eval_dataset_is_read_once_and_checked_before_the_model_loads(vlm_run, tmp_path, capsys, no_load):
    from torchforge.trainer import cli

    settings = {**vlm_run, "eval_dataset": vlm_run["dataset"], "eval_steps": 1}
    rows = (tmp_path / "data" / "rows.jsonl").read_text().splitlines()
    (tmp_path / "data" / "eval.jsonl").write_text("\n".join([rows[0].replace("red.png", "gone.png")]))
    bad = {**settings, "eval_dataset": str(tmp_path / "data" / "eval.jsonl")}
    assert main(["train", *(f"{k}={json.dumps(v)}" for k, v in bad.items())]) == 2
    assert re.search(r"^eval_dataset:1: image file '.*data/gone.png' does not exist", _one_line(capsys))
    assert main(["eval", "--model", vlm_run["model"], "--dataset", bad["eval_dataset"], "--reward-function",
                 vlm_run["reward_functions"][0]]) == 2
    assert re.search(r"^dataset .*eval.jsonl:1: image file '.*data/gone.png' does not exist", _one_line(capsys))
    # check_run reads the JSONL files (image paths resolved); the trainer is built from those rows
    run = cli.check_run(settings)
    assert run.train_rows[0]["images"] == [str(tmp_path / "data" / "red.png")]
    assert run.eval_rows[2]["images"] == [str(tmp_path / "data" / "blue.png")]


def test_build_trainer_takes_the_rows_check_run_read(vlm_run, monkeypatch):
    from torchforge.trainer import cli

    run = cli.check_run(vlm_run)

    def read_again(*args, **kwargs):
        raise AssertionError("the dataset was read again")

    monkeypatch.setattr(cli, "read_dataset", read_again)
    trainer = cli.build_trainer(run)
    assert trainer.train_dataset[0]["images"] == run.train_rows[0]["images"] and trainer.vision


# --- the command's mistakes: one line, exit 2, before the model loads ---------------------------

@pytest.fixture
def no_load(monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    for cls in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
        monkeypatch.setattr(cls, "from_pretrained", refuse)


def _one_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0].removeprefix("error: ")


def test_a_missing_image_file_is_one_line_before_the_model_loads(vlm_run, tmp_path, capsys, no_load):
    rows = (tmp_path / "data" / "rows.jsonl").read_text().splitlines()
    rows[2] = rows[2].replace("blue.png", "gone.png")
    (tmp_path / "data" / "rows.jsonl").write_text("\n".join(rows))
    assert main(["train", *(f"{k}={json.dumps(v)}" for k, v in vlm_run.items())]) == 2
    assert re.search(r"^dataset .*rows.jsonl:3: image file '.*data/gone.png' does not exist", _one_line(capsys))


def test_images_for_a_text_only_model_are_one_line_before_it_loads(vlm_run, tmp_path, capsys, no_load):
    from torchforge.trainer.demo import char_tokenizer, tiny_llama

    tokenizer = char_tokenizer()
    tiny_llama(tokenizer).save_pretrained(tmp_path / "text")
    tokenizer.save_pretrained(tmp_path / "text")
    settings = {**vlm_run, "model": str(tmp_path / "text")}
    assert main(["train", *(f"{k}={json.dumps(v)}" for k, v in settings.items())]) == 2
    assert re.search(r"^the dataset's rows have images but model .*text' is text-only .*model_type 'llama'",
                     _one_line(capsys))


def test_a_vlm_folder_without_its_processor_is_one_line_before_it_loads(vlm_run, tmp_path, capsys, no_load):
    model, _ = tiny_qwen2_vl()
    model.save_pretrained(tmp_path / "bare")
    settings = {**vlm_run, "model": str(tmp_path / "bare")}
    assert main(["train", *(f"{k}={json.dumps(v)}" for k, v in settings.items())]) == 2
    assert re.search(r"'qwen2_vl'\) without a processor: no processor_config.json or preprocessor_config.json",
                     _one_line(capsys))


@pytest.mark.parametrize("setting, message", [
    ("padding_free=true", r"^torchforge train: padding_free=True with a vision-language model: its image inputs do "
                          r"not pack exactly; expected padding_free=False$"),
])
def test_settings_a_vlm_cannot_take_are_one_line_before_it_loads(vlm_run, capsys, no_load, setting, message):
    assert main(["train", *(f"{k}={json.dumps(v)}" for k, v in vlm_run.items()), setting]) == 2
    assert re.search(message, _one_line(capsys))


# --- the helpers ----------------------------------------------------------------------------

def test_relative_image_paths_resolve_from_the_dataset_folder(tmp_path):
    rows = [{"prompt": "a", "images": ["x.png", "/abs/y.png", "file:///z.png"]}, {"prompt": "b", "images": "w.png"},
            {"prompt": "c"}]
    assert resolve_image_paths(rows, tmp_path) == [
        {"prompt": "a", "images": [str(tmp_path / "x.png"), "/abs/y.png", "file:///z.png"]},
        {"prompt": "b", "images": str(tmp_path / "w.png")}, {"prompt": "c"}]
    assert chat_with_images("q", 0) == "q"
    assert chat_with_images("q", 2)[0]["content"][:2] == [{"type": "image"}, {"type": "image"}]


def test_dynamic_sampling_and_micro_batches_carry_the_vision_inputs(tmp_path):
    # dynamic sampling concatenates batches of several rounds (their vision inputs with them,
    # torchforge.loop.vision.cat_vision) and micro-batches slice them; every row keeps its own
    rows = [{"prompt": "what colour is the image ?", "images": [Image.new("RGB", (56, 56), c)], "answer": c}
            for c in COLOURS]
    model, processor = tiny_qwen2_vl(seed=0)
    trainer = _trainer(tmp_path, model, processor, rows, max_steps=1, dynamic_sampling=True, max_sampling_rounds=3,
                       micro_batch_size=2)
    scored, _ = trainer._dynamic_sampling(0, trainer.sample_step(0))
    batch = scored.batch
    assert batch.vision is not None and batch.vision.batch_size == batch.batch_size
    assert batch.vision["pixel_values", "length"].tolist() == [16] * batch.batch_size[0]
    from torchforge.trainer.trainer import _cat_padded  # the rounds' batches as one

    joined = _cat_padded([batch[:2], batch[2:]], 0)
    assert all(torch.equal(joined.vision[k, "data"], batch.vision[k, "data"]) for k in batch.vision.keys())
    from torchforge.loop import policy_log_probs

    with torch.no_grad():
        whole, _ = policy_log_probs(trainer.model, batch)
        for b in range(batch.batch_size[0]):
            torch.testing.assert_close(policy_log_probs(trainer.model, batch[b:b + 1])[0] * batch.mask[b:b + 1],
                                       whole[b:b + 1] * batch.mask[b:b + 1], atol=1e-5, rtol=1e-5)
    trainer.train()
