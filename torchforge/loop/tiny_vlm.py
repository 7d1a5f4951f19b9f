"""Tiny vision-language models and their processors, built locally: real Hugging Face VLMs to run the loop on.

As :mod:`torchforge.loop.tiny_model` does for text, nothing here downloads: a word-level
tokenizer with the model family's special tokens, a PIL image processor constructed from
arguments, a chat template string, and a randomly initialized model from a small config.

- :func:`tiny_qwen2_vl`: ``Qwen2VLForConditionalGeneration`` (3D M-RoPE positions, pixel
  values as [patches, D] concatenated over images, ``image_grid_thw``) and its processor;
- :func:`tiny_llava`: ``LlavaForConditionalGeneration`` (a CLIP vision tower, a Llama
  language model, one ``<image>`` token expanded to the image's patches) and its processor.

Each returns ``(model, processor)``; ``save_tiny_vlm`` writes both to a folder that
``torchforge train model=<folder>`` loads. The vision demo (:mod:`torchforge.trainer.demo_vision`)
trains the Qwen2-VL one.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from tokenizers import decoders
from transformers import PreTrainedTokenizerFast

__all__ = ["vlm_tokenizer", "tiny_qwen2_vl", "tiny_llava", "save_tiny_vlm", "WORDS", "CHAT_TEMPLATE"]

#: the words of the tiny tokenizers' vocabulary (after the special tokens)
WORDS = ("user", "assistant", "system", "what", "colour", "is", "the", "shape", "how", "many", "shapes", "are",
         "there", "?", ".", "a", "an", "image", "of", "red", "green", "blue", "yellow", "white", "black",
         "one", "two", "three", "four", "yes", "no")

#: a chat template that renders ``{"type": "image"}`` parts as ``image_markup`` (set per family)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}IMAGE_MARKUP"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
)


def vlm_tokenizer(image_tokens: Sequence[str], words: Sequence[str] = WORDS) -> PreTrainedTokenizerFast:
    """A word-level Hugging Face tokenizer with chat and image special tokens, built locally.

    Args:
        image_tokens: the family's image special tokens (``<|vision_start|>``,
            ``<|image_pad|>``, ``<|vision_end|>`` for Qwen2-VL; ``<image>`` for LLaVA).
        words: the vocabulary's words; anything else is ``<unk>``.

    Returns:
        A ``PreTrainedTokenizerFast`` padding on the left, eos ``<|im_end|>``, pad ``<pad>``;
        ids: ``<pad>`` 0, ``<unk>`` 1, ``<|im_start|>`` 2, ``<|im_end|>`` 3, the image tokens,
        then the words.

    Example:
        >>> tokenizer = vlm_tokenizer(["<image>"])
        >>> tokenizer.decode(tokenizer("what colour is it")["input_ids"])
        'what colour is <unk>'
    """
    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", *image_tokens]
    vocab = {token: i for i, token in enumerate([*specials, *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>",
        padding_side="left",
    )


def _seeded(build, seed: int):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build().train()


def tiny_qwen2_vl(*, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, vision_depth: int = 1,
                  image_size: int = 56, seed: int = 0) -> tuple[Any, Any]:
    """A small randomly initialized Qwen2-VL and its processor (Qwen2-VL's own, images only).

    Images are resized to ``image_size`` x ``image_size`` (a multiple of 28): (image_size /
    14)^2 patches of 14 x 14 pixels, merged 2 x 2 into (image_size / 28)^2 ``<|image_pad|>``
    tokens.

    Args:
        hidden_size: H of the language model (and the vision tower's output).
        num_layers: decoder blocks.
        num_heads: attention heads (head dim ``hidden_size / num_heads``, a multiple of 8 for M-RoPE).
        vision_depth: vision transformer blocks.
        image_size: the side every image is resized to.
        seed: torch seed for the initialization.

    Returns:
        ``(model, processor)``: a ``Qwen2VLForConditionalGeneration`` in float32 (training
        mode) and a processor whose ``__call__(text=..., images=...)`` expands the image
        tokens (:func:`torchforge.loop.vision.images_processor`).

    Example:
        >>> model, processor = tiny_qwen2_vl()
        >>> model.config.model_type, processor.image_token
        ('qwen2_vl', '<|image_pad|>')
    """
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from torchforge.loop.vision import images_processor

    tokenizer = vlm_tokenizer(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"])
    ids = tokenizer.convert_tokens_to_ids
    head_dim = hidden_size // num_heads
    section = [head_dim // 2 - 2 * (head_dim // 6), head_dim // 6, head_dim // 6]  # sums to head_dim / 2
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=max(1, num_heads // 2), max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "mrope_section": section, "rope_theta": 10000.0},
                         bos_token_id=None, eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<pad>"),
                         tie_word_embeddings=False),
        vision_config=dict(depth=vision_depth, embed_dim=32, hidden_size=hidden_size, num_heads=2, mlp_ratio=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        bos_token_id=None, eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<pad>"), tie_word_embeddings=False,
    )
    model = _seeded(lambda: Qwen2VLForConditionalGeneration(config), seed)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=image_size * image_size, max_pixels=image_size * image_size,
                                               patch_size=14, merge_size=2, temporal_patch_size=2)
    template = CHAT_TEMPLATE.replace("IMAGE_MARKUP", "<|vision_start|><|image_pad|><|vision_end|>")
    processor = images_processor(Qwen2VLProcessor)(image_processor=image_processor, tokenizer=tokenizer,
                                                   chat_template=template)
    return model, processor


def tiny_llava(*, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, image_size: int = 28,
               seed: int = 0) -> tuple[Any, Any]:
    """A small randomly initialized LLaVA (CLIP vision tower, Llama language model) and its processor.

    Args:
        hidden_size: H of the language model.
        num_layers: decoder blocks.
        num_heads: attention heads.
        image_size: the side of the CLIP input (a multiple of 14): (image_size / 14)^2
            ``<image>`` tokens per image.
        seed: torch seed for the initialization.

    Returns:
        ``(model, processor)``: a ``LlavaForConditionalGeneration`` in float32 (training
        mode) and a ``LlavaProcessor``.

    Example:
        >>> model, processor = tiny_llava()
        >>> model.config.model_type, processor.image_token
        ('llava', '<image>')
    """
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = vlm_tokenizer(["<image>"])
    ids = tokenizer.convert_tokens_to_ids
    config = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=image_size, patch_size=14, projection_dim=32),
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=max(1, num_heads // 2),
                         max_position_embeddings=256, bos_token_id=None, eos_token_id=ids("<|im_end|>"),
                         pad_token_id=ids("<pad>"),
                         tie_word_embeddings=False),
        image_token_index=ids("<image>"), vision_feature_select_strategy="default", vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    model = _seeded(lambda: LlavaForConditionalGeneration(config), seed)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": image_size},
                                            crop_size={"height": image_size, "width": image_size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=CHAT_TEMPLATE.replace("IMAGE_MARKUP", "<image>"))
    return model, processor


def save_tiny_vlm(model: Any, processor: Any, folder: str) -> str:
    """Write a tiny VLM and its processor to ``folder`` (``model=<folder>`` for the CLI).

    Args:
        model: the model.
        processor: its processor.
        folder: the output folder.

    Returns:
        ``folder``.
    """
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    return folder
