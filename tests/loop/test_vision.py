"""Images in the loop (torchforge.loop.vision) on the tiny local Qwen2-VL and LLaVA: log-probs
equal the model's own log_softmax(logits) gathered (values and gradients), the vision inputs
padded per row and sliced with the batch, rollout through HFEngine with images, and the
one-line errors on bad inputs."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("PIL", reason="images need Pillow (the vision extra)")
from PIL import Image, ImageDraw  # noqa: E402

from torchforge.errors import InvalidArgumentError, TorchforgeError  # noqa: E402
from torchforge.loop import completion_stop_ids, policy_log_probs, rollout  # noqa: E402
from torchforge.loop.engines import HFEngine  # noqa: E402
from torchforge.loop.tiny_vlm import save_tiny_vlm, tiny_llava, tiny_qwen2_vl  # noqa: E402
from torchforge.loop.vision import (  # noqa: E402
    cat_vision,
    check_dataset_images,
    check_vision_model_folder,
    load_images,
    load_processor,
    placeholder_ids,
    row_images,
    stack_vision,
    vision_model_inputs,
    vision_tower_parameters,
)

FAMILIES = {"qwen2_vl": tiny_qwen2_vl, "llava": tiny_llava}
QUESTION = [{"type": "text", "text": "what colour is the shape ?"}]


def shape_image(colour: str, size: int = 56, box=(12, 12, 44, 44)) -> Image.Image:
    image = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(image).ellipse(box, fill=colour)
    return image


def prompt(processor, n_images: int) -> str:
    content = [{"type": "image"}] * n_images + QUESTION
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)


# the largest |logit| of the scaled heads (realistic magnitudes: 20-40 nats, as tests/loop/_arch_worker.py)
TARGET_LOGIT = 36.0


@pytest.fixture(scope="module", params=[(name, scaled) for name in sorted(FAMILIES) for scaled in (False, True)],
                ids=lambda p: f"{p[0]}-{'scaled' if p[1] else 'plain'}")
def vlm(request):
    name, scaled = request.param
    model, processor = FAMILIES[name](seed=1)
    if scaled:  # the head scaled so that the logits on an image prompt reach TARGET_LOGIT
        enc = processor(text=[prompt(processor, 1)], images=[shape_image("red")], return_tensors="pt")
        with torch.no_grad():
            top = float(model(**enc).logits.abs().max())
            model.get_output_embeddings().weight.mul_(TARGET_LOGIT / top)
    return name, model, processor


def _reference(model, processor, prompts, images, batch, temperature=1.0):
    """The model's own full logits, log_softmax, gather: the processor's batched output (its
    own padding, mm_token_type_ids), the completions appended, no position ids (Qwen2-VL
    computes its 3D positions from the grids)."""
    flat = [im for row in images for im in row]
    enc = processor(text=list(prompts), images=flat or None, return_tensors="pt", padding=True)
    # a completion that sampled an image placeholder stopped there: the logits up to it do not
    # depend on it, and the forward would count it as an image slot, so a plain token stands in
    completions = batch.tokens.masked_fill(torch.isin(batch.tokens, torch.tensor(placeholder_ids(model))), 0)
    ids = torch.cat([enc["input_ids"], completions], 1)
    attention = torch.cat([enc["attention_mask"], torch.ones_like(batch.tokens)], 1)
    extra = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    if "mm_token_type_ids" in enc:
        extra["mm_token_type_ids"] = torch.cat([enc["mm_token_type_ids"], torch.zeros_like(batch.tokens)], 1)
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False, **extra).logits
    log_p = (logits[:, enc["input_ids"].shape[1] - 1:-1].float() / temperature).log_softmax(-1)
    return enc, log_p


def _gathered(log_p, tokens):
    return log_p.gather(-1, tokens[..., None]).squeeze(-1)


# --- log-probs equal the model's own ---------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_entropy_and_gradients_equal_the_models_own(vlm, temperature):
    name, model, processor = vlm
    # rows of 2, 1 and 0 images (different vision lengths, a text-only row among them)
    images = [[shape_image("red"), shape_image("blue")], [shape_image("green")], []]
    prompts = [prompt(processor, len(row)) for row in images]
    batch = rollout(model, processor.tokenizer, prompts, num_generations=2, max_new_tokens=6, seed=4,
                    temperature=temperature, images=images, processor=processor)
    assert batch.vision is not None and batch.vision.batch_size == torch.Size([6])
    weights = torch.randn(batch.tokens.shape, generator=torch.Generator().manual_seed(0))

    model.zero_grad()
    log_probs, entropy = policy_log_probs(model, batch, temperature=temperature, return_entropy=True)
    (log_probs * weights * batch.mask).sum().backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    rep = [p for p in prompts for _ in range(2)]
    rep_images = [row for row in images for _ in range(2)]
    enc, log_p = _reference(model, processor, rep, rep_images, batch, temperature)
    naive = _gathered(log_p, batch.tokens)
    (naive * weights * batch.mask).sum().backward()

    # rollout's own left padding is the processor's
    assert torch.equal(batch.prompt_tokens, enc["input_ids"]) and torch.equal(batch.prompt_mask, enc["attention_mask"].bool())
    m = batch.mask
    torch.testing.assert_close(log_probs * m, naive * m, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy * m, -(log_p.exp() * log_p).sum(-1).detach() * m, atol=1e-5, rtol=1e-5)
    reference_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert fused.keys() == reference_grads.keys()
    assert any(n in fused for n in vision_tower_parameters(model))  # the gradient reaches the vision tower
    for n, g in reference_grads.items():
        torch.testing.assert_close(fused[n], g, atol=1e-5 + 1e-4 * float(g.abs().max()), rtol=1e-4, msg=n)
    model.zero_grad()
    # the sampler's log-probs are those of the same distribution (generate saw the images too)
    torch.testing.assert_close(batch.rollout_log_probs, log_probs.detach() * m, atol=1e-5, rtol=1e-5)


def test_the_images_change_the_log_probs(vlm):
    # the vision inputs reach the forward: the same tokens under another image score differently
    _, model, processor = vlm
    p = prompt(processor, 1)
    red = rollout(model, processor.tokenizer, [p], num_generations=2, max_new_tokens=4, seed=0,
                  images=[[shape_image("red")]], processor=processor)
    blue = red.clone()
    blue.vision = rollout(model, processor.tokenizer, [p], num_generations=2, max_new_tokens=1, seed=0,
                          images=[[shape_image("blue")]], processor=processor).vision
    with torch.no_grad():
        lp_red, _ = policy_log_probs(model, red)
        lp_blue, _ = policy_log_probs(model, blue)
    assert ((lp_red - lp_blue).abs() * red.mask).max() > 1e-4


def test_a_sampled_image_placeholder_ends_the_completion_and_scores_as_the_models_own(vlm):
    name, model, processor = vlm
    (placeholder,) = [i for i in placeholder_ids(model) if i == processor.tokenizer.convert_tokens_to_ids(
        processor.image_token)]
    assert set(placeholder_ids(model)) <= set(completion_stop_ids(processor.tokenizer, model))
    images = [[shape_image("red")]]
    prompts = [prompt(processor, 1)]
    batch = rollout(model, processor.tokenizer, prompts, num_generations=2, max_new_tokens=6, seed=2,
                    images=images, processor=processor)
    # a crafted completion: 2 tokens, then the placeholder (the stop), then padding
    _, log_p = _reference(model, processor, prompts * 2, images * 2, batch)  # the prefix decides each position
    tokens = batch.tokens.clone()
    tokens[:, 2] = placeholder
    tokens[:, 3:] = 0
    mask = torch.zeros_like(batch.mask)
    mask[:, :3] = True
    crafted = batch.clone()
    crafted.tokens, crafted.mask = tokens, mask
    with torch.no_grad():
        log_probs, _ = policy_log_probs(model, crafted)
    # positions <= 2 depend only on the tokens before them, the same as in the rollout's batch
    expected = log_p.gather(-1, torch.cat([batch.tokens[:, :2], tokens[:, 2:3]], 1)[..., None]).squeeze(-1)
    torch.testing.assert_close(log_probs[:, :3], expected.detach(), atol=1e-5, rtol=1e-5)


# --- padding and batching of the vision inputs ----------------------------------------------

def test_stack_vision_pads_each_row_and_vision_model_inputs_concatenates_the_real_parts():
    a, c = torch.arange(6.0).reshape(2, 3), 10 + torch.arange(3.0).reshape(1, 3)
    grid_a, grid_c = torch.tensor([[1, 2, 2]]), torch.tensor([[1, 4, 4]])
    td = stack_vision([{"pixel_values": a, "image_grid_thw": grid_a}, None, {"pixel_values": c, "image_grid_thw": grid_c}])
    assert td.batch_size == torch.Size([3])
    assert td["pixel_values", "data"].shape == (3, 2, 3) and td["pixel_values", "length"].tolist() == [2, 0, 1]
    assert torch.equal(td["pixel_values", "data"][1], torch.zeros(2, 3))  # the text row: zeros, length 0
    assert torch.equal(td["pixel_values", "data"][2, 1], torch.zeros(3))  # padding after row 2's one entry
    inputs = vision_model_inputs(td)
    assert torch.equal(inputs["pixel_values"], torch.cat([a, c]))
    assert torch.equal(inputs["image_grid_thw"], torch.cat([grid_a, grid_c]))
    # slicing rows slices their vision inputs exactly (micro-batches)
    assert torch.equal(vision_model_inputs(td[2:])["pixel_values"], c)
    assert vision_model_inputs(td[1:2]) == {}  # a text-only slice: nothing to pass
    assert stack_vision([None, None]) is None and vision_model_inputs(None) == {}
    # cat_vision undoes a split, text-only parts included
    joined = cat_vision([td[:1], None, td[1:]], [1, 2, 2])
    assert joined["pixel_values", "length"].tolist() == [2, 0, 0, 0, 1]
    assert torch.equal(vision_model_inputs(joined)["pixel_values"], torch.cat([a, c]))
    assert cat_vision([None, None], [1, 1]) is None


def test_stack_vision_rejects_rows_whose_trailing_shapes_differ():
    with pytest.raises(InvalidArgumentError, match=r"stack_vision: pixel_values of row 1 has shape \(1, 4\)"):
        stack_vision([{"pixel_values": torch.ones(2, 3)}, {"pixel_values": torch.ones(1, 4)}])


def test_micro_batch_log_probs_equal_the_whole_batchs(vlm):
    # each row's log-probs are its own: a slice (a micro-batch) of rows gives the same values
    _, model, processor = vlm
    images = [[shape_image("red"), shape_image("yellow")], [], [shape_image("blue")]]
    batch = rollout(model, processor.tokenizer, [prompt(processor, len(r)) for r in images], num_generations=1,
                    max_new_tokens=5, seed=7, images=images, processor=processor)
    with torch.no_grad():
        whole, _ = policy_log_probs(model, batch)
        for rows in (slice(0, 1), slice(1, 3), slice(2, 3)):
            part, _ = policy_log_probs(model, batch[rows])
            m = batch.mask[rows]
            torch.testing.assert_close(part * m, whole[rows] * m, atol=1e-5, rtol=1e-5)


def test_packing_refuses_a_batch_of_images():
    model, processor = tiny_qwen2_vl()
    batch = rollout(model, processor.tokenizer, [prompt(processor, 1)], num_generations=1, max_new_tokens=2,
                    seed=0, images=[[shape_image("red")]], processor=processor)
    with pytest.raises(TorchforgeError, match=r"policy_log_probs: packed=True with a batch of images .*padding_free=False"):
        policy_log_probs(model, batch, packed=True)


# --- rollout with images through HFEngine ----------------------------------------------------

def test_rollout_with_images_is_seeded_and_carries_the_vision_inputs():
    model, processor = tiny_qwen2_vl(seed=3)
    images = [[shape_image("red")], [shape_image("green"), shape_image("blue")]]
    prompts = [prompt(processor, len(r)) for r in images]
    kwargs = dict(num_generations=3, max_new_tokens=5, seed=11, images=images, processor=processor)
    first = rollout(model, processor.tokenizer, prompts, **kwargs)
    again = rollout(model, processor.tokenizer, prompts, engine=HFEngine(model), **kwargs)
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.mask, again.mask)
    # the G samples of a prompt share its vision inputs: (56 / 14)^2 = 16 patches per image,
    # merged 2 x 2 into 4 image tokens
    assert first.vision["pixel_values", "length"].tolist() == [16] * 3 + [32] * 3
    assert first.vision["image_grid_thw", "length"].tolist() == [1] * 3 + [2] * 3
    enc = processor(text=[prompts[1]], images=images[1], return_tensors="pt")
    assert torch.equal(first.vision["pixel_values", "data"][4], enc["pixel_values"])
    image_pad = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    assert (first.prompt_tokens == image_pad).sum(1).tolist() == [4] * 3 + [8] * 3  # expanded by the processor


class _TextOnlyEngine:
    def generate(self, prompt_token_ids, *, seeds, settings):
        raise AssertionError("not reached")


def test_rollout_refuses_images_without_a_processor_or_an_engine_that_takes_them():
    model, processor = tiny_llava()
    args = (model, processor.tokenizer, [prompt(processor, 1)])
    with pytest.raises(InvalidArgumentError, match=r"rollout: images were given without a processor"):
        rollout(*args, num_generations=1, max_new_tokens=2, images=[[shape_image("red")]])
    with pytest.raises(InvalidArgumentError, match=r"rollout: the prompts have images but _TextOnlyEngine.generate takes no vision="):
        rollout(*args, num_generations=1, max_new_tokens=2, images=[[shape_image("red")]], processor=processor,
                engine=_TextOnlyEngine())


def test_rollout_takes_processed_vision_inputs_for_token_id_prompts():
    # a multi-turn context: token ids with the image tokens expanded, and their vision inputs
    from torchforge.loop.vision import encode_vision_prompts

    model, processor = tiny_qwen2_vl(seed=3)
    prompts, images = [prompt(processor, 1), prompt(processor, 0)], [[shape_image("red")], []]
    ids, vision = encode_vision_prompts(processor, prompts, images)
    kwargs = dict(num_generations=2, max_new_tokens=4, seed=5)
    by_ids = rollout(model, processor.tokenizer, ids, vision=vision, **kwargs)
    by_text = rollout(model, processor.tokenizer, prompts, images=images, processor=processor, **kwargs)
    assert torch.equal(by_ids.tokens, by_text.tokens) and torch.equal(by_ids.prompt_tokens, by_text.prompt_tokens)
    assert all(torch.equal(by_ids.vision[k, "data"], by_text.vision[k, "data"]) for k in by_text.vision.keys())
    with pytest.raises(InvalidArgumentError, match=r"^rollout: 1 vision inputs for 2 prompts; expected one each$"):
        rollout(model, processor.tokenizer, ids, vision=vision[:1], **kwargs)
    with pytest.raises(InvalidArgumentError, match=r"^rollout: vision was given with string prompts"):
        rollout(model, processor.tokenizer, prompts, vision=vision, **kwargs)
    with pytest.raises(InvalidArgumentError, match=r"^rollout: both images and vision were given"):
        rollout(model, processor.tokenizer, prompts, images=images, vision=vision, processor=processor, **kwargs)


# --- images from the dataset and the model folder --------------------------------------------

def test_load_images_reads_paths_and_file_urls_relative_to_the_dataset(tmp_path):
    Image.new("RGB", (8, 8), "red").save(tmp_path / "a.png")
    images = load_images(["a.png", f"file://{tmp_path / 'a.png'}", shape_image("blue", size=4)], base=tmp_path)
    assert [im.size for im in images] == [(8, 8), (8, 8), (4, 4)] and all(im.mode == "RGB" for im in images)
    assert images[0].getpixel((4, 4)) == (255, 0, 0)
    assert load_images(None) == []


def test_bad_images_are_one_line_errors(tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"rows.jsonl:3: image file '.*missing.png' does not exist"):
        load_images("missing.png", base=tmp_path, where="rows.jsonl:3")
    with pytest.raises(InvalidArgumentError, match=r"only local files are read \(no download\)"):
        load_images("https://example.com/a.png")
    with pytest.raises(InvalidArgumentError, match=r"an image is a int; expected a PIL image"):
        load_images([3])
    row = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, *QUESTION]}],
           "images": [shape_image("red")]}
    with pytest.raises(InvalidArgumentError, match=r"the prompt has 2 image part\(s\) but the row has 1 image"):
        row_images(row)
    # the whole dataset, before any model loads; the row is named (1-based)
    shape_image("red", size=8).save(tmp_path / "ok.png")
    rows = [{"prompt": "a", "images": ["ok.png"]}, {"prompt": "b", "images": ["gone.png"]}]
    with pytest.raises(InvalidArgumentError, match=r"data:2: image file '.*gone.png' does not exist") as info:
        check_dataset_images(rows, base=tmp_path, name="data")
    assert "\n" not in str(info.value)
    assert check_dataset_images(rows[:1], base=tmp_path) is True
    assert check_dataset_images([{"prompt": "a"}, {"prompt": "b", "images": []}]) is False


def test_model_folder_checks_before_loading(tmp_path):
    from torchforge.loop.tiny_model import char_tokenizer, tiny_llama

    text = tmp_path / "text"
    tiny_llama(char_tokenizer()).save_pretrained(text)
    with pytest.raises(InvalidArgumentError, match=r"the dataset's rows have images but model .* is text-only .*'llama'"):
        check_vision_model_folder(str(text), has_images=True)
    assert check_vision_model_folder(str(text), has_images=False) is False
    model, processor = tiny_qwen2_vl()
    bare = tmp_path / "bare"
    model.save_pretrained(bare)  # no processor beside it
    with pytest.raises(InvalidArgumentError, match=r"is a vision-language model \('qwen2_vl'\) without a processor"):
        check_vision_model_folder(str(bare), has_images=True)
    full = save_tiny_vlm(model, processor, str(tmp_path / "full"))
    assert check_vision_model_folder(full, has_images=True) is True
    assert json.loads((tmp_path / "full" / "config.json").read_text())["model_type"] == "qwen2_vl"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_saved_tiny_vlm_loads_with_its_processor_without_torchvision(tmp_path, name):
    from transformers import AutoModelForImageTextToText

    model, processor = FAMILIES[name](seed=2)
    folder = save_tiny_vlm(model, processor, str(tmp_path / name))
    loaded, again = AutoModelForImageTextToText.from_pretrained(folder), load_processor(folder)
    text, images = prompt(processor, 1), [shape_image("red")]
    ours, theirs = processor(text=[text], images=images, return_tensors="pt"), again(text=[text], images=images,
                                                                                     return_tensors="pt")
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    with torch.no_grad():
        torch.testing.assert_close(loaded(**theirs).logits, model.eval()(**ours).logits, atol=0, rtol=0)
    model.train()
