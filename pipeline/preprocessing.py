"""A package's image preprocessing as data (``preprocess.json``), and the registry that runs it.

``preprocess(image, spec)`` dispatches on ``spec["kind"]`` to a function registered with
:func:`register_preprocessor`; each kind names the fields it needs (checked against
:mod:`pipeline.schema` before it runs, so a wrong field is named). No torch here: the exported
package's runtime reads images with numpy and PIL alone.

Kinds:

* ``latex_ocr_junia.canvas``: the default model's ink crop on a white canvas (its adapter uses the same helpers).
* ``hf_image_processor``: the resize / center crop / rescale / normalize pipeline of Hugging Face's
  ViT, DeiT and BEiT image processors, as data (:func:`hf_preprocess_spec` builds it from a
  ``preprocessor_config.json``); its output equals ``ViTImageProcessor(...)(image).pixel_values[0]``.
"""
from __future__ import annotations

from math import ceil
from typing import Callable

import numpy as np
from PIL import Image

from pipeline.data.render import INK_THRESHOLD, crop_to_ink
from pipeline.errors import PipelineError, SchemaError
from pipeline.schema import INT, PREPROCESS, Spec, check_fields

Preprocessor = Callable[[Image.Image, dict], np.ndarray]

_PREPROCESSORS: dict[str, tuple[Preprocessor, dict[str, Spec]]] = {}


def register_preprocessor(kind: str, fields: dict[str, Spec] | None = None) -> Callable[[Preprocessor], Preprocessor]:
    """Register ``fn(image, spec) -> float32 [C, H, W]`` for ``spec["kind"] == kind``; ``fields``: the
    spec's fields that kind needs beyond :data:`pipeline.schema.PREPROCESS` (checked before each call)."""
    def wrap(fn: Preprocessor) -> Preprocessor:
        if kind in _PREPROCESSORS:
            raise ValueError(f"preprocessing kind {kind!r} is registered twice")
        _PREPROCESSORS[kind] = (fn, dict(fields or {}))
        return fn
    return wrap


def known_kinds() -> list[str]:
    return sorted(_PREPROCESSORS)


def check_spec(spec: dict, where: str = "preprocess.json") -> tuple[Preprocessor, dict[str, Spec]]:
    """The kind's function after the spec's fields are checked; one-line errors naming the field."""
    if not isinstance(spec, dict):
        raise SchemaError(f"{where}: must be a JSON object, got {type(spec).__name__}")
    kind = spec.get("kind")
    if kind not in _PREPROCESSORS:
        raise PipelineError(f"{where}: unsupported preprocessing kind {kind!r} "
                            f"(known kinds: {', '.join(known_kinds())})")
    fn, fields = _PREPROCESSORS[kind]
    if (err := check_fields(spec, {**PREPROCESS, **fields})) is not None:
        raise SchemaError(f"{where}: {err}")
    return fn, fields


def preprocess(image: Image.Image, spec: dict) -> np.ndarray:
    """The model's inference preprocessing described by ``spec`` -> float32 [C, H, W]."""
    fn, _ = check_spec(spec)
    return fn(image, spec)


# ---- latex_ocr_junia.canvas ----------------------------------------------------------------------
CANVAS_MARGIN = 8  # px of white kept around the formula when it has to shrink


def to_grey(image: Image.Image) -> Image.Image:
    """Any PIL mode (RGB, RGBA, LA, P, 16-bit, float) -> 8-bit grey, transparency on white."""
    if image.width == 0 or image.height == 0:
        raise ValueError("image has zero size")
    if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        arr = np.asarray(image, dtype=np.float64)
        hi = float(arr.max())
        scale = 65535.0 if image.mode.startswith("I;16") or hi > 255 else 255.0
        if image.mode == "F" and hi <= 1.0:
            scale = 1.0
        arr = np.clip(arr / scale * 255.0, 0, 255)
        return Image.fromarray(arr.astype(np.uint8), mode="L")
    if image.mode == "P":
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA"):
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        background.alpha_composite(image.convert("RGBA"))
        image = background
    return image.convert("L")


def place_on_canvas(grey: Image.Image, height: int, width: int, margin: int = CANVAS_MARGIN) -> Image.Image:
    """The training layout: ink crop centred on a white canvas, shrunk (never enlarged) to fit."""
    arr = np.asarray(grey)
    if arr.size and np.median(np.concatenate([arr[0], arr[-1], arr[:, 0], arr[:, -1]])) < 128:
        grey = Image.fromarray(255 - arr)  # white ink on black: the model reads black on white
    crop = crop_to_ink(grey, INK_THRESHOLD)
    canvas = Image.new("L", (width, height), 255)
    if crop is None:
        return canvas
    w, h = crop.size
    scale = min(1.0, (width - 2 * margin) / w, (height - 2 * margin) / h)
    if scale < 1.0:
        crop = crop.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.BILINEAR)
        w, h = crop.size
    canvas.paste(crop, ((width - w) // 2, (height - h) // 2))
    return canvas


@register_preprocessor("latex_ocr_junia.canvas", {"margin": INT(0), "scale": Spec("number", min=1e-9)})
def _canvas(image: Image.Image, spec: dict) -> np.ndarray:
    """Any image -> 8-bit grey -> ink crop centred on a white canvas -> float32 / scale, [1, H, W]."""
    canvas = place_on_canvas(to_grey(image), int(spec["height"]), int(spec["width"]), int(spec["margin"]))
    return (np.asarray(canvas, dtype=np.float32) / float(spec["scale"]))[None]


# ---- hf_image_processor --------------------------------------------------------------------------
HF_KIND = "hf_image_processor"
HF_FIELDS = {
    "channels": INT(1, max=3),
    "do_resize": Spec("bool"),
    "resample": INT(0, max=5),
    "do_center_crop": Spec("bool", optional=True),
    "crop_height": INT(1, optional=True),
    "crop_width": INT(1, optional=True),
    "do_rescale": Spec("bool"),
    "rescale_factor": Spec("number"),
    "do_normalize": Spec("bool"),
    "image_mean": Spec("list", items=Spec("number")),
    "image_std": Spec("list", items=Spec("number")),
}


def _eight_bit(image: Image.Image) -> Image.Image:
    """16-bit and float modes scaled into 8-bit grey (PIL's own conversion would clip them)."""
    arr = np.asarray(image, dtype=np.float64)
    hi = float(arr.max()) if arr.size else 0.0
    scale = 65535.0 if image.mode.startswith("I;16") or hi > 255 else 255.0
    if image.mode == "F" and hi <= 1.0:
        scale = 1.0
    return Image.fromarray(np.clip(arr / scale * 255.0, 0, 255).astype(np.uint8), mode="L")


def to_mode(image: Image.Image, channels: int) -> Image.Image:
    """Any PIL image -> 8-bit ``RGB`` (3 channels) or ``L`` (1), transparency composited on white
    (formulas are black on white), as transformers' ``convert_to_rgb`` does it."""
    if image.width == 0 or image.height == 0:
        raise ValueError("image has zero size")
    if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        image = _eight_bit(image)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), rgba).convert("RGB")
    want = "RGB" if channels == 3 else "L"
    return image if image.mode == want else image.convert(want)


def _center_crop(arr: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' ``image_transforms.center_crop`` on [C, H, W]: a crop, zero-padded where the
    image is smaller than the crop (the same offsets)."""
    h, w = arr.shape[-2:]
    top, left = (h - height) // 2, (w - width) // 2
    bottom, right = top + height, left + width
    if top >= 0 and bottom <= h and left >= 0 and right <= w:
        return arr[..., top:bottom, left:right]
    new_h, new_w = max(height, h), max(width, w)
    padded = np.zeros_like(arr, shape=arr.shape[:-2] + (new_h, new_w))
    top_pad, left_pad = ceil((new_h - h) / 2), ceil((new_w - w) / 2)
    padded[..., top_pad:top_pad + h, left_pad:left_pad + w] = arr
    top, bottom, left, right = top + top_pad, bottom + top_pad, left + left_pad, right + left_pad
    return padded[..., max(0, top):min(new_h, bottom), max(0, left):min(new_w, right)]


@register_preprocessor(HF_KIND, HF_FIELDS)
def _hf_image_processor(image: Image.Image, spec: dict) -> np.ndarray:
    """transformers' PIL backend step for step: 8-bit image -> PIL resize -> center crop -> x * factor
    (float64, then float32) -> (x - mean) / std in float32, [C, H, W]."""
    channels = int(spec["channels"])
    if channels not in (1, 3):
        raise SchemaError(f"{HF_KIND}: field 'channels' must be 1 or 3, got {channels}")
    for key in ("image_mean", "image_std"):
        if spec["do_normalize"] and len(spec[key]) != channels:
            raise SchemaError(f"{HF_KIND}: field {key!r} must have {channels} entries (channels), got {len(spec[key])}")
    image = to_mode(image, channels)
    if spec["do_resize"]:
        image = image.resize((int(spec["width"]), int(spec["height"])), resample=int(spec["resample"]))
    arr = np.asarray(image)
    arr = arr[None] if arr.ndim == 2 else np.moveaxis(arr, -1, 0)  # [C, H, W] uint8
    if spec.get("do_center_crop"):
        arr = _center_crop(arr, int(spec["crop_height"]), int(spec["crop_width"]))
    if spec["do_rescale"]:
        arr = (arr.astype(np.float64) * float(spec["rescale_factor"])).astype(np.float32)
    if spec["do_normalize"]:
        arr = arr.astype(np.float32, copy=False)
        mean = np.asarray(spec["image_mean"], dtype=np.float32)[:, None, None]
        std = np.asarray(spec["image_std"], dtype=np.float32)[:, None, None]
        arr = (arr - mean) / std
    return np.ascontiguousarray(arr, dtype=np.float32)


def output_shape(spec: dict) -> tuple[int, int, int]:
    """[C, H, W] of what ``preprocess`` gives for ``spec`` (the encoder's input)."""
    if spec.get("kind") == HF_KIND and spec.get("do_center_crop"):
        return int(spec["channels"]), int(spec["crop_height"]), int(spec["crop_width"])
    return int(spec.get("channels", 1)), int(spec["height"]), int(spec["width"])


# ---- preprocessor_config.json -> spec -----------------------------------------------------------
_BILINEAR, _BICUBIC = 2, 3
_HF_DEFAULTS = {  # the classes' defaults in transformers (image_processing_*vit/deit/beit.py)
    "ViT": {"size": {"height": 224, "width": 224}, "resample": _BILINEAR, "do_center_crop": False},
    "DeiT": {"size": {"height": 256, "width": 256}, "resample": _BICUBIC, "do_center_crop": True,
             "crop_size": {"height": 224, "width": 224}},
    "Beit": {"size": {"height": 224, "width": 224}, "resample": _BICUBIC, "do_center_crop": False,
             "crop_size": {"height": 224, "width": 224}},
}
_SUPPORTED = "ViT/DeiT/Beit image processors (and *Fast, *Pil, *FeatureExtractor) with size {height, width}"


def _family(config: dict) -> str | None:
    name = config.get("image_processor_type") or config.get("feature_extractor_type") or ""
    for suffix in ("ImageProcessorFast", "ImageProcessorPil", "ImageProcessor", "FeatureExtractor"):
        if name.endswith(suffix) and name[:-len(suffix)] in _HF_DEFAULTS:
            return name[:-len(suffix)]
    return None


def _hw(value, what: str) -> tuple[int, int]:
    """A size as {"height", "width"} (or an int: a square, as ViT reads it)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value, value
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if v is not None}
    if isinstance(value, dict) and set(value) == {"height", "width"} \
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value.values()):
        return value["height"], value["width"]
    raise PipelineError(f"preprocessor_config.json: {what} {value!r} is not supported; supported: {_SUPPORTED}")


def _per_channel(value, channels: int, what: str) -> list[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [float(value)] * channels
    if isinstance(value, list) and len(value) == channels and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return [float(v) for v in value]
    raise PipelineError(f"preprocessor_config.json: {what} {value!r} does not have {channels} entries "
                        f"(the model reads {channels} channel(s))")


def hf_preprocess_spec(config: dict, channels: int) -> dict:
    """The ``hf_image_processor`` spec of a ``preprocessor_config.json`` (its class's defaults where a
    field is absent), for a model reading ``channels`` (1 or 3) channels. Anything the spec cannot
    reproduce exactly (Donut's thumbnail/pad/align_long_axis, ``size: {shortest_edge}``, padding) is
    refused with one line saying what is supported."""
    if channels not in (1, 3):
        raise PipelineError(f"hf_image_processor: channels must be 1 or 3, got {channels}")
    family = _family(config)
    if family is None:
        name = config.get("image_processor_type") or config.get("feature_extractor_type")
        raise PipelineError(f"preprocessor_config.json: image processor {name!r} is not supported; "
                            f"supported: {_SUPPORTED}")
    unsupported = [k for k in ("do_thumbnail", "do_align_long_axis", "do_pad", "do_reduce_labels", "crop_pct")
                   if config.get(k)]
    if unsupported:
        raise PipelineError(f"preprocessor_config.json: {', '.join(unsupported)} is not supported; "
                            f"supported: {_SUPPORTED}, optional center crop, rescale, normalize")
    defaults = _HF_DEFAULTS[family]
    height, width = _hw(config.get("size", defaults["size"]), "size")
    do_resize = bool(config.get("do_resize", True))
    do_crop = bool(config.get("do_center_crop", defaults["do_center_crop"]))
    resample = config.get("resample", defaults["resample"])
    if not isinstance(resample, int) or isinstance(resample, bool) or not 0 <= resample <= 5:
        raise PipelineError(f"preprocessor_config.json: resample {resample!r} is not a PIL resampling code (0-5)")
    if not do_resize and not do_crop:
        raise PipelineError("preprocessor_config.json: do_resize false without a center crop gives images of any "
                            "size; the exported encoder reads one fixed size")
    spec = {"kind": HF_KIND, "channels": channels, "height": height, "width": width, "do_resize": do_resize,
            "resample": resample, "do_center_crop": do_crop}
    if do_crop:
        spec["crop_height"], spec["crop_width"] = _hw(config.get("crop_size", defaults.get("crop_size")), "crop_size")
    do_normalize = bool(config.get("do_normalize", True))
    factor = config.get("rescale_factor", 1 / 255)
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        raise PipelineError(f"preprocessor_config.json: rescale_factor {factor!r} is not a number")
    spec.update({
        "do_rescale": bool(config.get("do_rescale", True)), "rescale_factor": float(factor),
        "do_normalize": do_normalize,
        "image_mean": _per_channel(config.get("image_mean", [0.5, 0.5, 0.5]), channels, "image_mean")
        if do_normalize else [0.0] * channels,
        "image_std": _per_channel(config.get("image_std", [0.5, 0.5, 0.5]), channels, "image_std")
        if do_normalize else [1.0] * channels,
        "processor": config.get("image_processor_type") or config.get("feature_extractor_type"),
        "note": "any image -> 8-bit RGB or L (transparency on white) -> PIL resize to height x width "
                "-> optional center crop -> x * rescale_factor -> (x - mean) / std, float32 [C, H, W]",
    })
    return spec
