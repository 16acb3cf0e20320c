"""The registries behind an exported package's runtime: preprocessing kinds (``pipeline/preprocessing.py``,
the HF image processors' pipeline as data, equal to transformers' own output) and tokenizer kinds
(``package_tokenizer`` with ``package.json: tokenizer.kind``, any HF ``tokenizers`` JSON)."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from PIL import Image, ImageDraw

from pipeline import preprocessing
from pipeline.errors import PipelineError, SchemaError
from pipeline.preprocessing import hf_preprocess_spec, output_shape, preprocess, register_preprocessor
from pipeline.tokenization.hf import HfTokenizer


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert text and "\n" not in text, text
    return text


# ---- images --------------------------------------------------------------------------------------
def formula(mode: str = "RGB", size=(173, 61)) -> Image.Image:
    """Black-ish strokes on white with a little colour, in ``mode`` (transparent modes: clear background)."""
    rng = np.random.default_rng(7)
    im = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(im)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, size[0] - 20)), int(rng.integers(0, size[1] - 10))
        colour = tuple(int(c) for c in rng.integers(0, 120, 3))
        draw.line([(x0, y0), (x0 + int(rng.integers(5, 20)), y0 + int(rng.integers(2, 10)))], fill=colour, width=2)
    if mode in ("RGB", "L"):
        return im.convert(mode)
    alpha = Image.fromarray((255 - np.asarray(im.convert("L"))).astype(np.uint8))  # ink opaque, paper clear
    rgba = im.copy()
    rgba.putalpha(alpha)
    if mode == "RGBA":
        return rgba
    if mode == "LA":
        return rgba.convert("LA")
    if mode == "P":  # a palette image whose white entry is transparent
        p = im.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
        white = p.getpixel((0, 0))
        p.info["transparency"] = white
        return p
    raise ValueError(mode)


def hf(cls_name: str, **kwargs):
    """transformers' processor on its PIL backend (what ``ViTImageProcessor`` is without torchvision)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if cls_name == "ViT":
            from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil as cls
        elif cls_name == "DeiT":
            from transformers.models.deit.image_processing_pil_deit import DeiTImageProcessorPil as cls
        else:
            from transformers.models.beit.image_processing_pil_beit import BeitImageProcessorPil as cls
        return cls(**kwargs)


def hf_pixels(processor, image: Image.Image, **call) -> np.ndarray:
    return processor(image, return_tensors="np", **call).pixel_values[0]


# ---- the preprocessing registry -------------------------------------------------------------------
def test_an_unknown_preprocessing_kind_is_one_line_naming_the_known_kinds():
    with pytest.raises(PipelineError) as err:
        preprocess(formula(), {"kind": "nougat.pad", "height": 8, "width": 8})
    text = one_line(err)
    assert "'nougat.pad'" in text and "hf_image_processor" in text and "latex_ocr_junia.canvas" in text


def test_a_registered_kind_is_dispatched_and_its_fields_are_checked():
    from pipeline.schema import INT

    @register_preprocessor("test.ones", {"depth": INT(1)})
    def ones(image, spec):
        return np.ones((spec["depth"], spec["height"], spec["width"]), np.float32)

    try:
        out = preprocess(formula(), {"kind": "test.ones", "height": 3, "width": 5, "depth": 2})
        assert out.shape == (2, 3, 5) and out.dtype == np.float32
        with pytest.raises(SchemaError) as err:
            preprocess(formula(), {"kind": "test.ones", "height": 3, "width": 5})
        assert "'depth' is missing" in one_line(err)
        with pytest.raises(ValueError):
            register_preprocessor("test.ones")(ones)
    finally:
        preprocessing._PREPROCESSORS.pop("test.ones")


def test_the_canvas_kind_is_the_default_models_preprocessing():
    """What runtime.preprocess_image did before the registry, byte for byte."""
    from pipeline.adapters.latex_ocr_junia import CANVAS_MARGIN, place_on_canvas, to_grey
    from pipeline.export.runtime import preprocess_image

    spec = {"kind": "latex_ocr_junia.canvas", "channels": 1, "height": 64, "width": 256, "margin": CANVAS_MARGIN,
            "scale": 255.0}
    for mode in ("RGB", "L", "RGBA", "P"):
        image = formula(mode, (300, 90))
        before = (np.asarray(place_on_canvas(to_grey(image), 64, 256, CANVAS_MARGIN), dtype=np.float32) / 255.0)[None]
        for out in (preprocess(image, spec), preprocess_image(image, spec)):
            assert out.dtype == np.float32 and out.shape == (1, 64, 256)
            np.testing.assert_array_equal(out, before)
    with pytest.raises(SchemaError) as err:
        preprocess(formula(), {k: v for k, v in spec.items() if k != "margin"})
    assert "'margin' is missing" in one_line(err)


# ---- hf_image_processor: transformers' own output ---------------------------------------------------
@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "LA", "P"])
@pytest.mark.parametrize("resample", [2, 3])
def test_the_vit_spec_equals_transformers_on_three_channels(mode, resample):
    config = {"image_processor_type": "ViTImageProcessor", "size": {"height": 48, "width": 160}, "resample": resample,
              "image_mean": [0.5, 0.4, 0.3], "image_std": [0.5, 0.6, 0.7]}
    spec = hf_preprocess_spec(config, 3)
    image = formula(mode)
    ours = preprocess(image, spec)
    theirs = hf_pixels(hf("ViT", **{k: v for k, v in config.items() if k != "image_processor_type"}), image,
                       do_convert_rgb=True)  # grey and transparent images: RGB, transparency on white
    assert ours.dtype == np.float32 and ours.shape == theirs.shape == (3, 48, 160) == output_shape(spec)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


def test_the_vit_spec_equals_transformers_on_one_channel():
    config = {"image_processor_type": "ViTImageProcessor", "size": {"height": 40, "width": 96},
              "image_mean": [0.5], "image_std": [0.5]}
    spec = hf_preprocess_spec(config, 1)
    image = formula("L")
    theirs = hf_pixels(hf("ViT", size=config["size"], image_mean=[0.5], image_std=[0.5]), image)
    ours = preprocess(image, spec)
    assert ours.shape == theirs.shape == (1, 40, 96)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    # an RGB or transparent image for a grey model: composited on white, then grey (PIL's luma)
    rgba = formula("RGBA")
    white = Image.alpha_composite(Image.new("RGBA", rgba.size, "white"), rgba).convert("L")
    np.testing.assert_allclose(preprocess(rgba, spec), hf_pixels(hf("ViT", size=config["size"], image_mean=[0.5],
                                                                     image_std=[0.5]), white), atol=1e-5, rtol=0)


def test_a_transparent_formula_lands_on_white():
    spec = hf_preprocess_spec({"image_processor_type": "ViTImageProcessor", "size": {"height": 16, "width": 16},
                               "do_normalize": False}, 3)
    clear = Image.new("RGBA", (30, 30), (0, 0, 0, 0))  # transparent black: paper
    np.testing.assert_allclose(preprocess(clear, spec), np.ones((3, 16, 16), np.float32), atol=1e-6)


def test_rescale_and_normalize_switches_equal_transformers():
    image = formula("RGB")
    for flags in ({"do_rescale": False}, {"do_normalize": False}, {"do_rescale": False, "do_normalize": False},
                  {"rescale_factor": 1 / 127.5, "image_mean": [1.0, 1.0, 1.0], "image_std": [1.0, 1.0, 1.0]}):
        config = {"image_processor_type": "ViTImageProcessorFast", "size": {"height": 32, "width": 64}, **flags}
        theirs = hf_pixels(hf("ViT", size=config["size"], **flags), image)
        np.testing.assert_allclose(preprocess(image, hf_preprocess_spec(config, 3)), theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("size, crop", [({"height": 72, "width": 200}, {"height": 64, "width": 181}),
                                        ({"height": 40, "width": 100}, {"height": 47, "width": 90})])
def test_the_deit_center_crop_equals_transformers(size, crop):
    """Including a crop taller than the resized image (transformers pads it with zeros)."""
    config = {"image_processor_type": "DeiTImageProcessor", "size": size, "crop_size": crop}
    spec = hf_preprocess_spec(config, 3)
    assert spec["do_center_crop"] and spec["resample"] == 3  # DeiT's defaults
    image = formula("RGB")
    theirs = hf_pixels(hf("DeiT", size=size, crop_size=crop), image)
    ours = preprocess(image, spec)
    assert ours.shape == theirs.shape == output_shape(spec)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


def test_defaults_and_saved_configs_of_each_family_equal_transformers():
    image = formula("RGB", (90, 260))
    for family in ("ViT", "DeiT", "Beit"):
        processor = hf(family)
        saved = json.loads(json.dumps(processor.to_dict()))  # what preprocessor_config.json holds
        bare = {"image_processor_type": f"{family}ImageProcessor"}  # every other field: the class default
        theirs = hf_pixels(processor, image)
        for config in (saved, bare):
            np.testing.assert_allclose(preprocess(image, hf_preprocess_spec(config, 3)), theirs, atol=1e-5, rtol=0)


def test_a_trocr_feature_extractor_config_is_read():
    """microsoft/trocr-*'s preprocessor_config.json: the old feature extractor name and an int size."""
    config = {"do_normalize": True, "do_resize": True, "feature_extractor_type": "ViTFeatureExtractor",
              "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2, "size": 384}
    spec = hf_preprocess_spec(config, 3)
    assert (spec["height"], spec["width"], spec["resample"]) == (384, 384, 2)
    image = formula("RGB")
    np.testing.assert_allclose(preprocess(image, spec), hf_pixels(hf("ViT", size={"height": 384, "width": 384}), image),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("config, channels, needle", [
    ({"image_processor_type": "DonutImageProcessor", "do_thumbnail": True, "do_align_long_axis": False,
      "do_pad": True, "size": {"height": 2560, "width": 1920}}, 3, "'DonutImageProcessor'"),
    ({"image_processor_type": "ViTImageProcessor", "size": {"shortest_edge": 384}}, 3, "size"),
    ({"image_processor_type": "ViTImageProcessor", "do_pad": True}, 3, "do_pad"),
    ({"image_processor_type": "ViTImageProcessor", "do_center_crop": True}, 3, "crop_size"),
    ({"image_processor_type": "DeiTImageProcessor", "crop_size": {"shortest_edge": 224}}, 3, "crop_size"),
    ({"image_processor_type": "ViTImageProcessor", "do_resize": False}, 3, "do_resize"),
    ({"image_processor_type": "ViTImageProcessor"}, 1, "image_mean"),
    ({"image_processor_type": "ViTImageProcessor", "resample": "bilinear"}, 3, "resample"),
    ({"size": {"height": 32, "width": 32}}, 3, "None"),
])
def test_unsupported_processor_configs_are_refused_in_one_line(config, channels, needle):
    with pytest.raises(PipelineError) as err:
        hf_preprocess_spec(config, channels)
    text = one_line(err)
    assert needle in text, text


def test_a_broken_hf_spec_names_the_field():
    spec = hf_preprocess_spec({"image_processor_type": "ViTImageProcessor"}, 3)
    with pytest.raises(SchemaError) as err:
        preprocess(formula(), {**spec, "image_mean": "half"})
    assert "'image_mean'" in one_line(err)
    with pytest.raises(SchemaError) as err:
        preprocess(formula(), {**spec, "image_mean": [0.5]})
    assert "3 entries" in one_line(err)


# ---- HfTokenizer ----------------------------------------------------------------------------------
TEXTS = ["the quick brown fox", "jumps over the lazy dog", "x squared plus y squared", "a fox and a dog",
         "the sum of x over i", "brown dog, quick fox!"] * 20


def train_bpe(path, byte_level: bool, specials=("<s>", "<pad>", "</s>", "<unk>")):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None if byte_level else "<unk>"))
    if byte_level:  # TrOCR's RoBERTa: byte-level BPE, the decoder puts the spaces back
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=300 if byte_level else 120, special_tokens=list(specials),
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(TEXTS, trainer)
    tok.save(str(path))
    return tok


@pytest.fixture
def byte_level(tmp_path):
    path = tmp_path / "tokenizer.json"
    train_bpe(path, byte_level=True)
    return path


def test_a_byte_level_bpe_round_trips_plain_text(byte_level):
    tok = HfTokenizer(byte_level, bos_id=0, eos_id=2, pad_id=1)
    for text in ("the quick brown fox", "a dog, a fox!", "x squared plus zebra"):
        ids = tok.encode(text)
        assert ids[0] == 0 and ids[-1] == 2 and 0 not in ids[1:-1] and 2 not in ids[1:-1]
        assert tok.decode(ids[1:]) == text  # what greedy decoding gives: tokens after BOS, EOS last
    assert tok.decode(tok.encode("the fox")) == "the fox"  # a BOS in front is dropped too
    assert tok.vocab_size == 300 and len(tok.token_strings()) == 300  # 256 bytes, 4 specials, merges
    assert tok.token_strings()[:4] == ["<s>", "<pad>", "</s>", "<unk>"]
    capped = tok.encode("the quick brown fox", max_length=3)
    assert len(capped) == 3 and capped[0] == 0 and capped[-1] == 2


def test_decode_stops_at_eos_and_skips_specials(byte_level):
    tok = HfTokenizer(byte_level, bos_id=0, eos_id=2, pad_id=1)
    fox = tok.encode("fox", max_length=None)[1:-1]
    dog = tok.encode(" dog")[1:-1]
    assert tok.decode([*fox, 2, *dog]) == "fox"
    assert tok.decode([1, *fox, 3, 1, *dog]) == "fox dog"  # pad and the tokenizer's <unk> (special) dropped
    assert tok.decode([2, *fox]) == ""


def test_a_whitespace_bpe_decodes_as_its_tokenizer_joins_it(tmp_path):
    path = tmp_path / "tokenizer.json"
    train_bpe(path, byte_level=False)
    tok = HfTokenizer(path, bos_id=0, eos_id=2)
    ids = tok.encode("the quick fox")
    assert tok.decode(ids[1:]) == "the quick fox" and tok.pad_id is None


def test_trocr_style_specials_where_bos_is_eos(byte_level):
    """TrOCR starts decoding from </s> (decoder_start_token_id == eos): greedy's tokens come after it."""
    tok = HfTokenizer(byte_level, bos_id=2, eos_id=2, pad_id=1)
    ids = tok.encode("lazy dog")
    assert ids[0] == ids[-1] == 2 and tok.decode(ids[1:]) == "lazy dog"


@pytest.mark.parametrize("content, needle", [(None, "missing"), (b"garbage", "not a usable"),
                                             (b'{"model": {"type": "BPE"}}', "not a usable")])
def test_a_missing_or_garbage_tokenizer_is_one_line(tmp_path, content, needle):
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(PipelineError) as err:
        HfTokenizer(path, 0, 2, 1)
    text = one_line(err)
    assert needle in text and "tokenizer.json" in text


def test_special_ids_outside_the_vocabulary_are_refused(byte_level):
    with pytest.raises(PipelineError) as err:
        HfTokenizer(byte_level, bos_id=0, eos_id=500, pad_id=1)
    assert "eos_id 500" in one_line(err)


# ---- runtime.package_tokenizer --------------------------------------------------------------------
def test_package_tokenizer_reads_the_kind_from_package_json(tmp_path, byte_level):
    from pipeline.export.runtime import CharTokenizer, package_tokenizer
    from pipeline.tokenization.bpe import BpeTokenizer

    meta = {"tokenizer": {"file": "tokenizer.json", "kind": "hf"}, "bos_id": 0, "eos_id": 2, "pad_id": 1}
    tok = package_tokenizer(byte_level, meta)
    assert isinstance(tok, HfTokenizer) and (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 2, 1)
    assert tok.decode(tok.encode("quick dog")[1:]) == "quick dog"
    tok = package_tokenizer(byte_level, {k: v for k, v in meta.items() if k != "pad_id"})
    assert tok.pad_id is None

    with pytest.raises(PipelineError) as err:
        package_tokenizer(byte_level, {**meta, "tokenizer": {"kind": "sentencepiece"}})
    text = one_line(err)
    assert "'sentencepiece'" in text and all(k in text for k in ("bpe", "char", "hf"))

    # the formula BPE (the char vocabulary's specials at ids 0-3) and the char vocabulary: as before
    formula_bpe = tmp_path / "formula.json"
    train_bpe(formula_bpe, byte_level=False, specials=("<pad>", "<bos>", "<eos>", "<unk>"))
    chars = tmp_path / "chars.json"
    chars.write_text(json.dumps({"token_to_id": {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, "x": 4},
                                 "specials": {"pad": "<pad>", "bos": "<bos>", "eos": "<eos>", "unk": "<unk>"}}))
    for meta in (None, {}, {"tokenizer": {"kind": "bpe"}}):
        assert isinstance(package_tokenizer(formula_bpe, meta), BpeTokenizer)
    for meta in (None, {"tokenizer": {"file": "tokenizer.json"}}, {"tokenizer": {"kind": "char"}}):
        tok = package_tokenizer(chars, meta)
        assert isinstance(tok, CharTokenizer) and tok.decode([4, 4, 2, 4]) == "xx"


def test_the_package_schema_takes_the_new_kinds():
    from pipeline.schema import PACKAGE, PREPROCESS, check_fields

    spec = hf_preprocess_spec({"image_processor_type": "ViTImageProcessor"}, 3)
    assert check_fields(spec, PREPROCESS) is None
    assert "'tokenizer.kind'" in check_fields({"tokenizer": {"kind": 3}}, {"tokenizer": PACKAGE["tokenizer"]})
    hf_kind = {"tokenizer": {"kind": "hf", "file": "tokenizer.json"}}
    assert check_fields(hf_kind, {"tokenizer": PACKAGE["tokenizer"]}) is None
