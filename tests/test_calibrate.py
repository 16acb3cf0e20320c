"""Stage calibrate and calibration/sets.py: sources, bad input, stratification, determinism, and
that the set holds exactly the adapter's preprocessing of its images."""
from __future__ import annotations

import copy
import io
import json
import shutil
import struct
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from calibration import sets
from conftest import make_ctx, run_cli
from pipeline.data.render import render_formula
from pipeline.errors import PipelineError

SUBSET = 64  # calib formulas a stage test renders


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def calib_formulas(corpus):
    return [f for f in corpus if f.split == "calib"]


@pytest.fixture(scope="module")
def rendered(calib_formulas, real_adapter):
    """The first 160 calib formulas rendered (in parallel) and measured once for this module."""
    source = sets.CorpusSource(calib_formulas[:160])
    return source, source.scan(real_adapter.preprocess, progress=False)


def _artifacts_with_corpus(corpus_root: Path, root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(corpus_root / "corpus", root / "corpus")
    return root


def _ctx(root: Path, overrides: list[str], adapter, formulas=None, asked=None):
    """A stage context on ``root``; the corpus calib split cut to ``formulas`` (fast), the model
    the session's real adapter (loaded once)."""
    ctx = make_ctx(root, ["stage=calibrate", *overrides])
    ctx.load_model = lambda ref="original": adapter
    if formulas is not None:
        real_split = ctx.split

        def split(name):
            if asked is not None:
                asked.append(name)
            return formulas if name == "calib" else real_split(name)
        ctx.split = split
    return ctx


def _run(ctx):
    from pipeline.stages import calibrate
    from omegaconf import OmegaConf

    return calibrate.run(OmegaConf.to_object(ctx.cfg.calibrate), ctx)


def _png_bytes(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", **kw)
    return buf.getvalue()


def _zero_width_png() -> bytes:
    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 0, 10, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def _variant(grey: Image.Image, i: int, folder: Path, stem: str) -> Path:
    """One rendered formula saved as one of the modes and formats a folder meets in practice."""
    arr = np.asarray(grey)
    kind = i % 8
    if kind == 0:
        path = folder / f"{stem}.png"
        grey.save(path)
    elif kind == 1:  # RGBA: black ink, coverage in the alpha channel, transparent background
        rgba = np.zeros(arr.shape + (4,), np.uint8)
        rgba[..., 3] = 255 - arr
        path = folder / f"{stem}.png"
        Image.fromarray(rgba, "RGBA").save(path)
    elif kind == 2:  # 16-bit grey
        path = folder / f"{stem}.png"
        Image.fromarray(arr.astype(np.uint16) * 257).save(path)
    elif kind == 3:
        path = folder / f"{stem}.png"
        grey.convert("P").save(path)
    elif kind == 4:  # white ink on black
        path = folder / f"{stem}.png"
        Image.fromarray(255 - arr).save(path)
    elif kind == 5:
        path = folder / f"{stem}.bmp"
        grey.convert("RGB").save(path)
    elif kind == 6:
        path = folder / f"{stem}.tiff"
        grey.convert("RGB").save(path)
    else:
        path = folder / f"{stem}.jpg"
        grey.save(path, quality=95)
    return path


GOOD = 40
BAD = {
    "corrupt.png": lambda img: bytes(np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8)),
    "truncated.png": lambda img: _png_bytes(img)[: len(_png_bytes(img)) // 2],
    "notes.txt": lambda img: b"formula images for calibration\n",
    "empty.png": lambda img: b"",
    "zero_width.png": lambda img: _zero_width_png(),
    "blank.png": lambda img: _png_bytes(Image.new("L", (80, 30), 255)),
}


@pytest.fixture(scope="module")
def image_folder(rendered, tmp_path_factory):
    """40 distinct formula images in eight modes/formats, six bad files, an exact and a near copy."""
    source, scan = rendered
    folder = tmp_path_factory.mktemp("images")
    images = [source.image(c.source_id) for c in scan.candidates[:GOOD]]
    for i, img in enumerate(images):
        _variant(img, i, folder, f"f{i:02d}")
    for name, make in BAD.items():
        (folder / name).write_bytes(make(images[0]))
    shutil.copyfile(folder / "f00.png", folder / "zz_copy.png")
    images[0].save(folder / "zz_near.jpg", quality=85)
    return folder


# ---- the corpus source ------------------------------------------------------------------------
def test_corpus_set_is_the_adapters_preprocessing_and_byte_identical(corpus_root, calib_formulas, real_adapter,
                                                                     tmp_path):
    import datasets

    asked: list[str] = []
    outs = []
    for run in ("a", "b"):
        root = _artifacts_with_corpus(corpus_root, tmp_path / run)
        ctx = _ctx(root, ["calibrate.size=32", f"calibrate.workers={1 if run == 'a' else 2}"], real_adapter,
                   calib_formulas[:SUBSET], asked)
        outs.append(_run(ctx))
    assert set(asked) == {"calib"}  # never the eval split
    a, b = (tmp_path / r / "calibrate" for r in ("a", "b"))
    data_files = sorted(p.relative_to(a) for p in (a / "calib_set").glob("*.arrow"))
    assert data_files
    for rel in data_files + [Path("contact_sheet.png"), Path("buckets.png")]:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel

    ds = datasets.load_from_disk(str(a / "calib_set")).with_format("torch")
    assert len(ds) == 32 and len(set(ds["source_id"])) == 32
    texts = {f.id: f.latex for f in calib_formulas[:SUBSET]}
    for row in ds:
        assert row["text"] == texts[row["source_id"]]
        assert torch.equal(row["pixel_values"], real_adapter.preprocess(render_formula(row["text"])))

    m = outs[0]["metrics"]
    assert m["scheme"] == "text" and m["size"] == 32
    assert sum(b["source"] for b in m["buckets"].values()) == m["usable"]
    assert sum(b["set"] for b in m["buckets"].values()) == 32
    assert Counter(ds["bucket"]) == Counter({k: v["set"] for k, v in m["buckets"].items() if v["set"]})
    assert m["coverage"] == pytest.approx(m["covered_buckets"] / m["nonempty_source_buckets"], abs=1e-6)
    manifest = json.loads((a / "manifest.json").read_text())
    assert "calib_set/" + data_files[0].name in manifest["outputs"]
    with Image.open(a / "contact_sheet.png") as sheet, Image.open(a / "buckets.png") as hist:
        assert sheet.width > 256 and hist.width > 256


def test_seed_decides_the_selection(rendered):
    _, scan = rendered
    scan = copy.deepcopy(scan)
    sets.remove_duplicates(scan, 0.02)
    sets.assign_buckets(scan)
    pick = lambda seed: [c.source_id for c in sets.select(scan, 32, seed)]  # noqa: E731
    assert pick(0) == pick(0)
    assert pick(0) != pick(1)


def test_rare_kinds_of_formula_survive_a_skewed_source(rendered):
    """A source that is almost all short formulas: the few fractions and big operators still get in."""
    _, scan = rendered
    skewed = copy.deepcopy(scan)
    common = [c for c in skewed.candidates if c.structure in ("plain", "scripts")]
    rare = [c for c in skewed.candidates if c.structure in ("frac", "bigop")][:4]
    assert len(common) >= 60 and len(rare) == 4
    skewed.candidates = common + rare
    sets.remove_duplicates(skewed, 0.02)
    sets.assign_buckets(skewed)
    n_buckets = len({c.bucket for c in skewed.candidates})
    size = max(32, n_buckets)
    chosen = sets.select(skewed, size, seed=0)
    report = sets.coverage_report(skewed, chosen)
    assert report["coverage"] == 1.0
    assert {c.bucket for c in rare} <= {c.bucket for c in chosen}
    assert {"frac", "bigop"} <= {c.structure for c in chosen}
    assert report["share_tv_distance"] <= sets.tv_bound(n_buckets, size)


def _fake(bucket: str, i: int) -> sets.Candidate:
    return sets.Candidate(source_id=f"{bucket}{i:04d}", text=None, ink_width=10, ink_height=10, ink_density=0.2,
                          digest=f"{bucket}{i}", thumb=np.zeros((16, 64), np.float32), bucket=bucket)


def test_stratified_selection_follows_the_source_shares():
    counts = {"common": 900, "uncommon": 90, "rare": 9, "single": 1}
    scan = sets.SourceScan("skewed", [_fake(b, i) for b, n in counts.items() for i in range(n)], scheme="image")
    chosen = sets.select(scan, 100, seed=3)
    got = Counter(c.bucket for c in chosen)
    total = sum(counts.values())
    assert sum(got.values()) == 100 and len({c.source_id for c in chosen}) == 100
    for bucket, n in counts.items():
        assert got[bucket] >= 1
        quota = 100 * n / total
        # within one seat of the quota: the floor seats of 'rare' and 'single' are paid by the others
        assert abs(got[bucket] - quota) <= 1
    assert got["common"] > 10 * got["rare"]
    report = sets.coverage_report(scan, chosen)
    assert report["coverage"] == 1.0 and report["share_tv_distance"] <= sets.tv_bound(4, 100)
    assert sets.allocate(counts, 100) == dict(got)


def test_fewer_buckets_seats_than_buckets_gives_the_largest_first():
    seats = sets.allocate({f"b{i}": 10 - i for i in range(10)}, 5)
    assert sum(seats.values()) == 5 and all(seats[f"b{i}"] == 1 for i in range(5))


def test_near_and_exact_duplicates_are_removed_distinct_formulas_kept(rendered, real_adapter):
    source, scan = rendered
    scan = copy.deepcopy(scan)
    first = scan.candidates[0]
    img = source.image(first.source_id)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=80)
    near = sets.measure("near", first.text, real_adapter.preprocess(Image.open(buf)))
    exact = sets.measure("exact", first.text, real_adapter.preprocess(img))
    n = len(scan.candidates)
    scan.candidates += [near, exact]
    sets.remove_duplicates(scan, 0.02)
    assert scan.duplicates["exact"] == f"exact duplicate of {first.source_id}"
    assert scan.duplicates["near"] == f"near duplicate of {first.source_id}"
    # the rendered corpus formulas are distinct texts: at most a rendering-identical pair goes
    assert len(scan.candidates) >= n - 2


# ---- an image folder ------------------------------------------------------------------------------
def test_image_folder_with_bad_files_builds_and_names_the_skips(image_folder, real_adapter, tmp_path, caplog):
    import logging

    import datasets

    caplog.set_level(logging.INFO, logger="pipeline.stages.calibrate")
    manifest = _run(_ctx(tmp_path, ["data=image_folder", f"data.path={image_folder}", "calibrate.size=32"],
                         real_adapter))
    m = manifest["metrics"]
    assert set(m["skipped_items"]) == set(BAD)
    assert "notes.txt: unsupported file type '.txt'" in m["skipped_items"]["notes.txt"]
    assert m["skipped_items"]["blank.png"] == "blank (no ink)"
    assert m["duplicates"] == 2 and m["duplicate_items"]["zz_copy.png"] == "exact duplicate of f00.png"
    assert m["duplicate_items"]["zz_near.jpg"] == "near duplicate of f00.png"
    assert m["usable"] == GOOD  # every mode and format decoded: grey, RGBA, 16-bit, palette, inverted, bmp, tiff, jpg
    assert m["scheme"] == "image" and m["size"] == 32
    logged = {level: " | ".join(r.getMessage() for r in caplog.records
                                if r.name == "pipeline.stages.calibrate" and r.levelname == level)
              for level in ("INFO", "WARNING")}
    assert "6 skipped" in logged["INFO"] and "corrupt.png" in logged["WARNING"]  # the skips are a warning

    ds = datasets.load_from_disk(str(tmp_path / "calibrate" / "calib_set")).with_format("torch")
    assert len(ds) == 32
    for row in ds:
        with Image.open(image_folder / row["source_id"]) as im:
            assert torch.equal(row["pixel_values"], real_adapter.preprocess(im)), row["source_id"]
        assert row["text"] is None


def test_too_few_usable_images_says_how_many_and_writes_nothing(image_folder, real_adapter, tmp_path):
    ctx = _ctx(tmp_path, ["data=image_folder", f"data.path={image_folder}", "calibrate.size=64"], real_adapter)
    with pytest.raises(PipelineError, match=rf"only {GOOD} usable images .*6 skipped, 2 duplicates"):
        _run(ctx)
    assert not list(tmp_path.iterdir())


def test_empty_folder_and_bad_config_are_one_clear_error(real_adapter, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PipelineError, match="holds no files"):
        _run(_ctx(tmp_path / "a", ["data=image_folder", f"data.path={empty}"], real_adapter))
    with pytest.raises(PipelineError, match="calibrate.size must be 32-4096"):
        _run(_ctx(tmp_path / "a", ["calibrate.size=16"], real_adapter))
    assert not (tmp_path / "a").exists()


@pytest.mark.slow
def test_missing_source_path_exits_2_with_one_line(tmp_path):
    proc = run_cli("stage=calibrate", "data=image_folder", f"data.path={tmp_path / 'nowhere'}",
                   f"artifacts.dir={tmp_path / 'art'}", "progress=false")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "nowhere" in lines[0] and "does not exist" in lines[0]
    assert not (tmp_path / "art" / "calibrate").exists()


# ---- a save_to_disk dataset -------------------------------------------------------------------
def test_hf_disk_source_with_text_and_a_corrupt_row(rendered, real_adapter, tmp_path):
    import datasets

    source, scan = rendered
    cands = scan.candidates[:36]
    rows = {"image": [{"bytes": _png_bytes(source.image(c.source_id)), "path": None} for c in cands],
            "latex": [c.text for c in cands]}
    rows["image"].append({"bytes": b"not a png", "path": None})
    rows["latex"].append("x")
    features = datasets.Features({"image": datasets.Image(), "latex": datasets.Value("string")})
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "ds"))

    manifest = _run(_ctx(tmp_path / "art", ["data=hf_disk", f"data.path={tmp_path / 'ds'}", "calibrate.size=32"],
                         real_adapter))
    m = manifest["metrics"]
    assert m["scheme"] == "text" and list(m["skipped_items"]) == ["row36"] and m["usable"] == 36
    ds = datasets.load_from_disk(str(tmp_path / "art" / "calibrate" / "calib_set")).with_format("torch")
    by_row = {f"row{i}": c for i, c in enumerate(cands)}
    for row in ds:
        c = by_row[row["source_id"]]
        assert row["text"] == c.text
        assert torch.equal(row["pixel_values"], real_adapter.preprocess(source.image(c.source_id)))

    with pytest.raises(PipelineError, match="'picture' is not a column"):
        _run(_ctx(tmp_path / "art2", ["data=hf_disk", f"data.path={tmp_path / 'ds'}", "data.image_column=picture"],
                  real_adapter))


def test_labelled_folder_is_bucketed_by_text_and_keeps_it(rendered, real_adapter, tmp_path):
    import datasets

    source, scan = rendered
    folder = tmp_path / "labelled"
    (folder / "nested").mkdir(parents=True)
    lines = []
    for i, c in enumerate(scan.candidates[:34]):
        rel = f"nested/{i:02d}.png" if i % 2 else f"{i:02d}.png"
        source.image(c.source_id).save(folder / rel)
        lines.append(f"{rel}\t{c.text}")
    lines.append("gone.png\tx^2")
    (folder / "labels.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")

    m = _run(_ctx(tmp_path / "art", ["data=image_folder", f"data.path={folder}", "calibrate.size=32"],
                  real_adapter))["metrics"]
    assert m["scheme"] == "text" and m["usable"] == 34
    assert m["skipped_items"] == {"gone.png": "labelled but no such file"}
    assert all(k.startswith("L") for k in m["buckets"])
    ds = datasets.load_from_disk(str(tmp_path / "art" / "calibrate" / "calib_set"))
    truth = dict(line.split("\t") for line in lines)
    assert all(row["text"] == truth[row["source_id"]] for row in ds)
