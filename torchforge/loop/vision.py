"""Images in the loop: dataset images, the processor, and the vision inputs a batch carries.

A vision-language model (VLM) reads a prompt's images through its processor: the processor
renders the chat template, expands each image placeholder into the model's image tokens
(so the prompt token ids already hold them) and emits the vision tensors the forward
takes (Qwen2-VL: ``pixel_values`` [patches, D] concatenated over images and
``image_grid_thw`` [images, 3]; LLaVA: ``pixel_values`` [images, C, H, W]; whatever the
processor emits, by name).

Those tensors are not [B, T]: a :class:`~torchforge.Batch` carries them in its one extra
field ``vision``, a ``TensorDict`` of batch size [B] with one entry per processor key,
``vision[key]["data"]`` [B, N, ...] (row b's tensor zero-padded along its first dim to the
batch's largest N) and ``vision[key]["length"]`` [B] int64 (row b's N). Slicing the batch
slices its rows' vision inputs exactly (micro-batches, dynamic sampling), and
:func:`vision_model_inputs` concatenates the rows' real parts back into what the model's
forward takes. The key vocabulary of DESIGN.md is unchanged.

Token-aligned processor outputs (``mm_token_type_ids``, ``token_type_ids``) are not stored:
:func:`token_type_inputs` recomputes them from the token ids, for prompt and completion alike.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from tensordict import TensorDict

from torchforge.errors import InvalidArgumentError

__all__ = [
    "VisionInputs",
    "load_images",
    "row_images",
    "check_dataset_images",
    "is_vision_config",
    "check_vision_model_folder",
    "is_processor_folder",
    "images_processor",
    "load_processor",
    "is_processor",
    "encode_vision_prompts",
    "join_vision",
    "image_placeholders",
    "stack_vision",
    "cat_vision",
    "vision_model_inputs",
    "token_type_inputs",
    "uses_mrope",
    "vision_tower_parameters",
    "is_vision_tower_name",
    "placeholder_ids",
]

# processor outputs that are not vision inputs (the ids) or that follow the tokens (recomputed)
_TEXT_KEYS = ("input_ids", "attention_mask")
_TOKEN_ALIGNED = ("mm_token_type_ids", "token_type_ids")


@dataclass
class VisionInputs:
    """One request's images, raw and processed.

    Args:
        images: the PIL images, in prompt order (what vLLM's ``multi_modal_data`` takes).
        tensors: the processor's vision outputs for this prompt alone, by name
            (``pixel_values``, ``image_grid_thw``, ...), each with a first dim to concatenate over rows.

    Returns:
        The record.
    """

    images: list[Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


# --- images from the dataset -------------------------------------------------------------

def _pil():
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow ships with the vision extra
        raise InvalidArgumentError("images need Pillow, which is not installed; install torchforge[vision]") from None
    return Image


def _image_path(image: str, base: Path | None) -> Path:
    path = image[len("file://"):] if image.startswith("file://") else image
    if "://" in path:
        raise InvalidArgumentError(
            f"image {image!r}: only local files are read (no download); expected a path or a file:// URL"
        )
    p = Path(path).expanduser()
    return p if p.is_absolute() or base is None else base / p


def load_images(images: Any, *, base: str | Path | None = None, where: str = "images") -> list[Any]:
    """A row's ``images`` as RGB PIL images: PIL images as they are, paths (absolute or
    relative to ``base``) and ``file://`` URLs read from disk; nothing is downloaded.

    Args:
        images: one image or a list of them (PIL images, paths, ``file://`` URLs), or None.
        base: the folder relative paths start from (the dataset file's folder).
        where: what an error names (``dataset rows.jsonl:3``).

    Returns:
        A list of RGB ``PIL.Image``; [] for None.

    Example:
        >>> from PIL import Image
        >>> [im.size for im in load_images(Image.new("RGB", (4, 2)))]
        [(4, 2)]
    """
    Image = _pil()
    if images is None:
        return []
    items = images if isinstance(images, (list, tuple)) else [images]
    out = []
    for item in items:
        if isinstance(item, Image.Image):
            out.append(item.convert("RGB"))
        elif isinstance(item, (str, Path)):
            path = _image_path(str(item), Path(base) if base is not None else None)
            if not path.is_file():
                raise InvalidArgumentError(f"{where}: image file {str(path)!r} does not exist; expected an image file")
            with Image.open(path) as opened:
                out.append(opened.convert("RGB"))
        elif isinstance(item, dict) and ("path" in item or "bytes" in item):  # a datasets Image feature
            if item.get("bytes"):
                import io

                out.append(Image.open(io.BytesIO(item["bytes"])).convert("RGB"))
            else:
                out.extend(load_images(item["path"], base=base, where=where))
        else:
            raise InvalidArgumentError(
                f"{where}: an image is a {type(item).__name__}; expected a PIL image, a path or a file:// URL"
            )
    return out


def _message_images(prompt: Any) -> int:
    """How many ``{"type": "image"}`` parts chat messages hold."""
    if not isinstance(prompt, list):
        return 0
    return sum(1 for message in prompt if isinstance(message, dict) and isinstance(message.get("content"), list)
               for part in message["content"] if isinstance(part, dict) and part.get("type") == "image")


def row_images(row: dict[str, Any], *, base: str | Path | None = None, where: str = "dataset") -> list[Any]:
    """The PIL images of a dataset row (its ``images``, or ``image``), checked against its
    prompt's ``{"type": "image"}`` parts when the prompt is chat messages.

    Args:
        row: a dataset row.
        base: the folder relative image paths start from.
        where: what an error names.

    Returns:
        A list of RGB PIL images ([] for a text row).
    """
    images = load_images(row.get("images", row.get("image")), base=base, where=where)
    parts = _message_images(row.get("prompt"))
    if parts and parts != len(images):
        raise InvalidArgumentError(f"{where}: the prompt has {parts} image part(s) but the row has {len(images)} "
                                   "image(s); expected one image per {'type': 'image'} part")
    return images


def check_dataset_images(rows: Any, *, base: str | Path | None = None, name: str = "dataset") -> bool:
    """Check every image path of a dataset exists (before any model loads); True if any row has images.

    Args:
        rows: the dataset rows (a list of dicts or a ``datasets.Dataset``).
        base: the folder relative image paths start from (the JSONL file's folder).
        name: the dataset's name in errors.

    Returns:
        Whether any row carries images.
    """
    any_images = False
    for i in range(len(rows)):
        row = rows[i]
        images = row.get("images", row.get("image")) if isinstance(row, dict) else None
        if images is None or images == []:
            continue
        any_images = True
        for item in images if isinstance(images, (list, tuple)) else [images]:
            if isinstance(item, (str, Path)):
                path = _image_path(str(item), Path(base) if base is not None else None)
                if not path.is_file():
                    raise InvalidArgumentError(f"{name}:{i + 1}: image file {str(path)!r} does not exist; "
                                               "expected a path to an image file (relative to the dataset's folder)")
    return any_images


# --- the model folder and its processor --------------------------------------------------

def is_vision_config(config: Any) -> bool:
    """True for a vision-language model's config (a dict from config.json, or a config object):
    it has a ``vision_config``."""
    if isinstance(config, dict):
        return config.get("vision_config") is not None
    return getattr(config, "vision_config", None) is not None


_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def is_processor_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds a saved processor (``processor_config.json`` or ``preprocessor_config.json``)."""
    return any((Path(folder) / f).is_file() for f in _PROCESSOR_FILES)


def check_vision_model_folder(folder: str, *, has_images: bool) -> bool:
    """One-line errors, before the model loads: images for a text-only model, a VLM without
    a processor config. Returns whether the model is a VLM.

    Args:
        folder: a local Hugging Face model folder (with config.json).
        has_images: whether the dataset's rows carry images.

    Returns:
        True for a vision-language model.
    """
    path = Path(folder)
    if not (path / "config.json").is_file():
        return False
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError:  # not JSON: loading the model says so
        return False
    vision = is_vision_config(config)
    if has_images and not vision:
        raise InvalidArgumentError(
            f"the dataset's rows have images but model {folder!r} is text-only (its config.json has no "
            "vision_config, model_type {!r}); expected a vision-language model".format(config.get("model_type"))
        )
    if vision and not is_processor_folder(path):
        raise InvalidArgumentError(
            f"model {folder!r} is a vision-language model ({config.get('model_type')!r}) without a processor: no "
            f"{' or '.join(_PROCESSOR_FILES)} in the folder; expected its processor saved beside it "
            "(processor.save_pretrained(folder))"
        )
    return vision


def images_processor(cls: type) -> type:
    """A processor class of ``cls`` (e.g. ``Qwen2VLProcessor``) that takes no video processor.

    Hugging Face's multimodal processors require a video processor, which needs torchvision;
    image-only training does not. The subclass keeps ``cls``'s own ``__call__`` (its image
    token expansion, ``mm_token_type_ids``), with ``image_processor`` and ``tokenizer`` only.

    Args:
        cls: a ``ProcessorMixin`` subclass whose ``__init__`` takes a ``video_processor``.

    Returns:
        The subclass (``cls`` itself when it takes no video processor).

    Example:
        >>> from transformers import Qwen2VLProcessor
        >>> images_processor(Qwen2VLProcessor).__name__
        'Qwen2VLProcessor'
    """
    if "video_processor" not in inspect.signature(cls.__init__).parameters:
        return cls

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        cls.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    # the same name: save_pretrained writes processor_class = cls's, which a full install loads
    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": __name__, "__qualname__": cls.__name__})


def is_processor(obj: Any) -> bool:
    """True for a multimodal processor (it has a tokenizer and an image processor)."""
    return getattr(obj, "tokenizer", None) is not None and getattr(obj, "image_processor", None) is not None


def load_processor(folder: str) -> Any:
    """The processor of a VLM folder: ``AutoProcessor``, else (no torchvision for its video
    processor) the family's processor class over ``AutoImageProcessor`` and ``AutoTokenizer``.

    Args:
        folder: a local model folder with a processor config.

    Returns:
        A processor (:func:`is_processor`).
    """
    import transformers
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        return AutoProcessor.from_pretrained(folder)
    except (AttributeError, ImportError, OSError, ValueError, TypeError) as error:  # OSError: no video processor
        first = error
    path = Path(folder)
    config = {}
    for name in _PROCESSOR_FILES:
        if (path / name).is_file():
            config = {**json.loads((path / name).read_text()), **config}
    cls = getattr(transformers, str(config.get("processor_class", "")), None)
    if cls is None:
        raise InvalidArgumentError(f"model {folder!r}: its processor could not be loaded ({first}); expected a "
                                   "processor_class that transformers has") from first
    template = path / "chat_template.jinja"
    chat_template = template.read_text() if template.is_file() else None
    kwargs = {k: v for k, v in config.items() if k in inspect.signature(cls.__init__).parameters
              and k not in ("image_processor", "tokenizer", "video_processor", "chat_template")}
    return images_processor(cls)(image_processor=AutoImageProcessor.from_pretrained(folder),
                                 tokenizer=AutoTokenizer.from_pretrained(folder), chat_template=chat_template, **kwargs)


# --- prompts with images -> token ids and vision inputs ------------------------------------

def encode_vision_prompts(processor: Any, prompts: Sequence[str], images: Sequence[Sequence[Any]], *,
                          add_special_tokens: bool | None = None) -> tuple[list[list[int]], list[VisionInputs | None]]:
    """Rendered prompts and their images through the processor: token ids with the image
    tokens expanded, and each prompt's vision inputs (None for a prompt without images).

    Args:
        processor: the model's processor.
        prompts: N rendered prompt strings (their image placeholders in place).
        images: N lists of PIL images.
        add_special_tokens: passed to the processor for a prompt with images (None: the
            processor's default; False for text appended after others, a multi-turn observation).

    Returns:
        ``(prompt_token_ids, vision)``: N lists of ids and N :class:`VisionInputs` or None.
    """
    if len(images) != len(prompts):
        raise InvalidArgumentError(f"encode_vision_prompts: {len(images)} image lists for {len(prompts)} prompts; "
                                   "expected one each")
    special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
    ids, vision = [], []
    for prompt, imgs in zip(prompts, images):
        if not imgs:
            ids.append(processor.tokenizer(prompt, add_special_tokens=bool(add_special_tokens))["input_ids"])
            vision.append(None)
            continue
        out = processor(text=[prompt], images=list(imgs), return_tensors="pt", **special)
        ids.append(out["input_ids"][0].tolist())
        tensors = {k: v for k, v in out.items() if k not in _TEXT_KEYS + _TOKEN_ALIGNED and isinstance(v, torch.Tensor)}
        vision.append(VisionInputs(list(imgs), tensors))
    return ids, vision


def join_vision(parts: Sequence[VisionInputs | None]) -> VisionInputs | None:
    """One sequence's vision inputs from those of its parts, in order (a multi-turn episode:
    the prompt's images, then each observation's): the images listed one after the other,
    each tensor concatenated along its first dim, as the forward reads the images of a
    sequence in the order their tokens appear.

    Args:
        parts: :class:`VisionInputs` or None (a part without images), in sequence order.

    Returns:
        The joined :class:`VisionInputs`, or None when no part has images.

    Example:
        >>> a = VisionInputs(["im0"], {"pixel_values": torch.zeros(2, 3)})
        >>> b = VisionInputs(["im1"], {"pixel_values": torch.ones(1, 3)})
        >>> joined = join_vision([a, None, b])
        >>> joined.images, joined.tensors["pixel_values"][:, 0].tolist()
        (['im0', 'im1'], [0.0, 0.0, 1.0])
    """
    real = [p for p in parts if p is not None]
    if not real:
        return None
    keys = sorted({k for p in real for k in p.tensors})
    for p in real:
        if sorted(p.tensors) != keys:
            raise InvalidArgumentError(f"join_vision: a part has the vision inputs {sorted(p.tensors)}, another "
                                       f"{keys}; expected the same processor outputs for every part")
    return VisionInputs([im for p in real for im in p.images],
                        {k: torch.cat([p.tensors[k] for p in real]) for k in keys})


def image_placeholders(processor: Any, text: str) -> int | None:
    """How many image placeholders (the processor's ``image_token``) a rendered text holds;
    None for a processor that names none."""
    token = getattr(processor, "image_token", None)
    return text.count(token) if isinstance(token, str) and token else None


def stack_vision(rows: Sequence[dict[str, torch.Tensor] | VisionInputs | None]) -> TensorDict | None:
    """B rows' vision tensors as the Batch's ``vision`` field (None when no row has any).

    ``vision[key]["data"]`` [B, N_max, ...]: row b's tensor, zero-padded along its first
    dim; ``vision[key]["length"]`` [B] int64: its N (0 for a row without it).

    Args:
        rows: per row, a dict of tensors, a :class:`VisionInputs` or None.

    Returns:
        A ``TensorDict`` of batch size [B], or None.

    Example:
        >>> td = stack_vision([{"pixel_values": torch.ones(2, 3)}, None, {"pixel_values": torch.ones(1, 3)}])
        >>> td["pixel_values", "data"].shape, td["pixel_values", "length"].tolist()
        (torch.Size([3, 2, 3]), [2, 0, 1])
    """
    tensors = [r.tensors if isinstance(r, VisionInputs) else (r or {}) for r in rows]
    keys = sorted({k for t in tensors for k in t})
    if not keys:
        return None
    B = len(tensors)
    out = {}
    for key in keys:
        example = next(t[key] for t in tensors if key in t)
        n_max = max((t[key].shape[0] for t in tensors if key in t), default=0)
        data = example.new_zeros((B, n_max, *example.shape[1:]))
        length = torch.zeros(B, dtype=torch.long)
        for b, t in enumerate(tensors):
            if key in t:
                if t[key].shape[1:] != example.shape[1:]:
                    raise InvalidArgumentError(
                        f"stack_vision: {key} of row {b} has shape {tuple(t[key].shape)}, another row's "
                        f"{tuple(example.shape)}; expected the same shape after the first dim")
                data[b, :t[key].shape[0]] = t[key]
                length[b] = t[key].shape[0]
        out[key] = TensorDict({"data": data, "length": length}, batch_size=[B])
    return TensorDict(out, batch_size=[B])


def cat_vision(parts: Sequence[TensorDict | None], sizes: Sequence[int]) -> TensorDict | None:
    """The ``vision`` fields of several batches (``sizes`` rows each) as one, rows in order."""
    if all(p is None for p in parts):
        return None
    rows: list[dict[str, torch.Tensor] | None] = []
    for part, size in zip(parts, sizes):
        if part is None:
            rows.extend([None] * size)
            continue
        for b in range(size):
            rows.append({key: part[key]["data"][b, :int(part[key]["length"][b])] for key in part.keys()})
    return stack_vision(rows)


def vision_model_inputs(vision: TensorDict | None) -> dict[str, torch.Tensor]:
    """The keyword arguments of the model's forward: each key's rows' real parts, concatenated.

    Args:
        vision: a Batch's ``vision`` field, or None.

    Returns:
        name -> tensor (keys no row has are left out); {} for None.

    Example:
        >>> td = stack_vision([{"pixel_values": torch.ones(2, 3)}, None, {"pixel_values": 2 * torch.ones(1, 3)}])
        >>> vision_model_inputs(td)["pixel_values"][:, 0].tolist()
        [1.0, 1.0, 2.0]
    """
    if vision is None:
        return {}
    out = {}
    for key in vision.keys():
        data, length = vision[key]["data"], vision[key]["length"]
        if int(length.sum()) == 0:
            continue
        keep = torch.arange(data.shape[1], device=data.device)[None, :] < length.to(data.device)[:, None]
        out[key] = data[keep]  # rows in order, each its first length[b] entries
    return out


def placeholder_ids(model: Any) -> list[int]:
    """The ids of a VLM's image / video placeholder tokens (``image_token_id``,
    ``image_token_index``, ``video_token_id``); [] for a text model.

    A completion that samples one of them ends there (:func:`torchforge.loop.completion_stop_ids`
    adds them to the stop ids): the model has no pixels to continue from, and its forward
    would count the token as an image slot. The training forward then feeds a plain token
    in its place (:func:`torchforge.loop.policy_log_probs`), which changes only the
    positions after it, none of which counts.
    """
    config = getattr(model, "config", None)
    if config is None or not is_vision_config(config):
        return []
    ids = {getattr(config, name, None) for name in ("image_token_id", "image_token_index", "video_token_id")}
    return sorted(int(i) for i in ids if isinstance(i, int))


def uses_mrope(model: Any) -> bool:
    """True for a model whose positions are 3D (Qwen2-VL's M-RoPE): the model computes them
    from the token ids, ``image_grid_thw`` and the attention mask."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for holder in (text, config):
        rope = getattr(holder, "rope_parameters", None) or getattr(holder, "rope_scaling", None) or {}
        if isinstance(rope, dict) and rope.get("mrope_section"):
            return True
    return False


def token_type_inputs(model: Any, input_ids: torch.Tensor, prompt_length: int) -> dict[str, torch.Tensor]:
    """``mm_token_type_ids`` (1 on image tokens, 2 on video tokens, of the prompt) for a model
    whose forward takes it (Qwen2-VL), as its processor makes it; completion tokens are 0,
    as ``generate`` extends it.

    Args:
        model: the VLM (or a peft model of it).
        input_ids: [B, L] ids, the first ``prompt_length`` the (padded) prompt.
        prompt_length: P.

    Returns:
        ``{"mm_token_type_ids": [B, L] int64}``, or {} for a model that takes none.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model: its base's forward
    if "mm_token_type_ids" not in inspect.signature(base.forward).parameters:
        return {}
    config = model.config
    types = torch.zeros_like(input_ids)
    prompt = input_ids[:, :prompt_length]
    for token, kind in (("image_token_id", 1), ("video_token_id", 2)):
        token_id = getattr(config, token, None)
        if token_id is not None:
            types[:, :prompt_length] = torch.where(prompt == token_id, kind, types[:, :prompt_length])
    return {"mm_token_type_ids": types}


# the submodules of a VLM that are its vision tower (and the projector into the text space)
_VISION_NAMES = ("visual", "vision_tower", "vision_model", "multi_modal_projector", "vision_embed", "vision")


def vision_tower_parameters(model: torch.nn.Module) -> list[str]:
    """Names of the parameters of a VLM's vision tower and projector (``visual.*``,
    ``vision_tower.*``, ``multi_modal_projector.*``, ...), by module name.

    Args:
        model: a Hugging Face VLM (or a wrapper of it).

    Returns:
        Parameter names.

    Example:
        >>> from torchforge.loop.tiny_vlm import tiny_llava
        >>> names = vision_tower_parameters(tiny_llava()[0])
        >>> bool(names) and all("vision_tower" in n or "multi_modal_projector" in n for n in names)
        True
    """
    return [name for name, _ in model.named_parameters() if is_vision_tower_name(name)]


def is_vision_tower_name(name: str) -> bool:
    """True for a parameter or module name inside a VLM's vision tower or projector
    (a dotted part ``visual``, ``vision_tower``, ``multi_modal_projector``, ...).

    Example:
        >>> is_vision_tower_name("model.visual.blocks.0.attn.qkv"), is_vision_tower_name("model.language_model.layers.0")
        (True, False)
    """
    return any(part in _VISION_NAMES for part in name.split("."))
