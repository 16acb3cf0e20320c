"""Hostile but realistic input through the CLI: every bad input is one ``error:`` line and exit code 2,
no traceback and no partial artifact; every interrupt is honoured and leaves the previous artifacts
byte-identical. Runs on the tiny random model (tests/tiny_model.py) exported once for the module."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest

from conftest import REPO, run_cli

FORMULAS = ["x^2", "a+b", r"\frac{a}{b}"]
TINY_MAX_POSITIONS = 64  # tests/tiny_model.py: ModelConfig(max_length=64)
EXPORT_ARGS = ["stage=export", "model.max_length=16", "export.parity_images=1", "export.parity_limit=2",
               "export.min_identical=0", "export.drafter=none", "progress=false"]  # no drafter: no corpus to build


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A tiny saved model, a formulas file, two rendered images and an exported tiny package."""
    from tiny_model import build_tiny

    from pipeline.data.render import render_formula

    root = tmp_path_factory.mktemp("hostile")
    build_tiny().save(root / "tiny")
    (root / "formulas.txt").write_text("\n".join(FORMULAS) + "\n", encoding="utf-8")
    images = root / "images"
    images.mkdir()
    for i, latex in enumerate(FORMULAS[:2]):
        render_formula(latex).save(images / f"f{i}.png")
    (images / "labels.tsv").write_text("".join(f"f{i}.png\t{t}\n" for i, t in enumerate(FORMULAS[:2])))
    proc = run_cli(*EXPORT_ARGS, f"export.model={root / 'tiny'}", f"export.formulas={root / 'formulas.txt'}",
                   f"artifacts.dir={root / 'art'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root


@pytest.fixture(scope="module")
def bomb(tmp_path_factory) -> Path:
    """A valid 20000 x 20000 1-bit PNG of a few kB: 400 M pixels once decoded."""
    path = tmp_path_factory.mktemp("bomb") / "bomb.png"
    w = h = 20000
    comp = zlib.compressobj(9)
    row = b"\x00" + b"\xff" * (w // 8)
    idat = b"".join(comp.compress(row) for _ in range(h)) + comp.flush()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0))
                     + chunk(b"IDAT", idat) + chunk(b"IEND", b""))
    return path


def one_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit code 2, exactly one non-blank stderr line, ``error: ...`` holding every needle, no traceback."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".old-")))


def copy_package(work: Path, dest: Path) -> Path:
    shutil.copytree(work / "art" / "export-ort_cpu", dest)
    return dest


# ---- 1. interrupts -------------------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_at_several_moments_leaves_the_previous_package_byte_identical(work, tmp_path):
    """A real export (CLI subprocess) is killed at moments spread over its run; each time the package
    published before is byte-identical, nothing temporary is left, stderr is one line."""
    art = tmp_path / "art"
    shutil.copytree(work / "art", art)
    package = art / "export-ort_cpu"
    before = tree_digest(package)
    args = [sys.executable, "-m", "pipeline", *EXPORT_ARGS, f"export.model={work / 'tiny'}",
            f"export.formulas={work / 'formulas.txt'}", f"artifacts.dir={art}", "artifacts.force=true"]
    env = {**os.environ, "MPLBACKEND": "Agg"}
    t0 = time.monotonic()  # one full forced run: how long the moments are spread over
    full = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    span = time.monotonic() - t0
    assert full.returncode == 0, full.stderr[-2000:]
    before = tree_digest(package)  # that run republished: this is the package to keep now
    interrupted = 0
    # moments: shares of a full run's wall time, and two phases seen on disk (the stage's temporary
    # folder exists: graphs are being built; package.json is written in it: parity is running)
    moments = [(0.15, signal.SIGTERM), (0.3, signal.SIGTERM), (0.5, signal.SIGINT), (0.7, signal.SIGTERM),
               (0.85, signal.SIGTERM), (0.95, signal.SIGTERM), (".tmp-export-*", signal.SIGTERM),
               (".tmp-export-*/package.json", signal.SIGINT)]
    for share, sig in moments:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if isinstance(share, float):
            time.sleep(share * span)
        else:
            while not list(art.glob(share)) and proc.poll() is None:
                time.sleep(0.05)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=300)
        assert "Traceback" not in out + err, (share, err[-3000:])
        assert leftovers(art) == [], share
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if tree_digest(package) != before:  # only a run that got past its commit point may change it
            finished = proc.returncode in (0, -sig) and "[export] export-ort_cpu (model" in out
            # or stopped during the swap, or after it (the one line then names the folder it published)
            said = "while publishing" in err or f"it had published {package}" in err
            assert finished or (proc.returncode == 2 and said and len(lines) == 1), (share, proc.returncode, err)
            before = tree_digest(package)
            continue
        if proc.returncode == 0:
            continue
        interrupted += 1
        if proc.returncode == -sig:  # before the handler (a loaded machine) or after the run: default action
            assert lines == [], (share, err)
        else:
            assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: interrupted"), \
                (share, proc.returncode, err)
    assert interrupted >= 4  # most moments fell inside the run (the two phase moments always do)


def test_a_swallowed_interrupt_ends_a_reading_after_its_batch(work):
    """A signal whose KeyboardInterrupt a callback ate (seen in CI: inside a WeakKeyDictionary callback
    during an evaluate reading, which then read on for minutes) stops torch's and ONNX Runtime's greedy
    reading, and the finetune, after the batch they are in."""
    import numpy as np
    import torch

    from pipeline import interrupts
    from pipeline.adapters import load_adapter
    from pipeline.errors import Interrupted
    from pipeline.export.runtime import OnnxPackage
    from pipeline.pruning import recover

    adapter = load_adapter("latex_ocr_junia", str(work / "tiny"))
    images = torch.rand(4, *adapter.input_shape)
    package = OnnxPackage(work / "art" / "export-ort_cpu", threads=1)
    readers = {"torch": lambda cb: adapter.generate(images, max_length=6, batch_size=2, progress=cb),
               "onnx": lambda cb: package.generate(images.numpy().astype(np.float32), max_length=6, batch_size=2,
                                                   progress=cb)}
    interrupts.reset()
    try:
        for name, reading in readers.items():
            seen: list[int] = []
            interrupts._received.append(signal.SIGTERM)  # the handler recorded it; its raise was eaten
            with pytest.raises(Interrupted, match="SIGTERM"):
                reading(seen.append)
            assert seen == [2], name                     # one batch, not both
            interrupts.reset()
        interrupts._received.append(signal.SIGTERM)
        with pytest.raises(Interrupted, match="SIGTERM"):
            recover.finetune(adapter, adapter, images, ["x"] * 4, steps=3, minutes=1.0, batch_size=2)
    finally:
        interrupts.reset()


def test_a_swallowed_interrupt_still_refuses_to_publish(tmp_path):
    """Native code that calls back into Python can swallow the KeyboardInterrupt; the flag outlives it."""
    from pipeline import interrupts
    from pipeline.artifacts import stage_output
    from pipeline.errors import Interrupted

    with stage_output(tmp_path, "demo", {"v": 1}, {}) as out:
        (out.path / "x.txt").write_text("old")
    before = tree_digest(tmp_path / "demo")
    interrupts.reset()
    try:
        with pytest.raises(Interrupted, match="SIGTERM"):
            with stage_output(tmp_path, "demo", {"v": 2}, {}) as out:
                (out.path / "x.txt").write_text("new")
                try:
                    interrupts._handler(signal.SIGTERM, None)  # what the signal does ...
                except KeyboardInterrupt:
                    pass                                       # ... and a callback that eats it
    finally:
        interrupts.reset()
    assert tree_digest(tmp_path / "demo") == before and leftovers(tmp_path) == []


def test_a_signal_as_the_temporary_folder_is_made_leaves_no_folder(tmp_path, monkeypatch):
    """A signal right after ``mkdtemp`` made the stage's (or a file's) temporary folder, before the code
    that cleans it up holds it: recorded there, raised inside, the folder removed (a CI run once caught
    an export there: its .tmp-export-* stayed)."""
    import tempfile

    from pipeline import interrupts
    from pipeline.artifacts import atomic_write_dir, stage_output
    from pipeline.errors import Interrupted

    made = tempfile.mkdtemp

    def signalled(*args, **kwargs):
        path = made(*args, **kwargs)
        interrupts._handler(signal.SIGTERM, None)  # what the signal does, the folder just made
        return path

    monkeypatch.setattr(tempfile, "mkdtemp", signalled)
    for opened in (lambda: stage_output(tmp_path, "demo", {"v": 1}, {}), lambda: atomic_write_dir(tmp_path / "file")):
        interrupts.reset()
        try:
            with pytest.raises(Interrupted, match="SIGTERM"):
                with opened():
                    pytest.fail("the work ran after the signal")
        finally:
            interrupts.reset()
        assert leftovers(tmp_path) == [] and not (tmp_path / "demo").exists()


def test_a_signal_inside_an_import_is_recorded_and_raised_after_it(tmp_path, monkeypatch):
    """A native module's initialisation that calls back into Python cannot carry the KeyboardInterrupt out
    (the process aborts: "terminate called ..."): inside an import the handler only records it, and the
    next check ends the run as interrupted."""
    from pipeline import interrupts
    from pipeline.errors import Interrupted

    (tmp_path / "signalled_during_import.py").write_text(
        "import signal, sys\nfrom pipeline import interrupts\n"
        "interrupts._handler(signal.SIGTERM, sys._getframe())\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    interrupts.reset()
    try:
        import signalled_during_import  # noqa: F401  (raises nothing: the import completes)
        assert signalled_during_import.DONE and interrupts.received()
        with pytest.raises(Interrupted, match="SIGTERM"):
            interrupts.check()
        with pytest.raises(KeyboardInterrupt):  # outside an import the handler raises at once
            interrupts._handler(signal.SIGTERM, sys._getframe())
    finally:
        interrupts.reset()
        sys.modules.pop("signalled_during_import", None)


def test_an_interrupt_a_finalizer_swallowed_prints_no_traceback(monkeypatch, capsys):
    """The handler's KeyboardInterrupt raised inside a ``__del__`` (seen: tqdm's, during a SIGTERM test)
    cannot propagate; Python would print "Exception ignored in ..." and a traceback beside the run's
    one error line. With a signal recorded the hook stays silent (the flag ends the run); without one
    Python's own report is kept."""
    from pipeline import interrupts

    class Finalized:
        def __del__(self):
            raise KeyboardInterrupt

    monkeypatch.setattr(sys, "unraisablehook", interrupts._unraisable)
    interrupts.reset()
    try:
        Finalized()
        assert "Exception ignored" in capsys.readouterr().err
        interrupts._received.append(signal.SIGTERM)
        Finalized()
        assert capsys.readouterr().err == ""
        assert interrupts.message() == "interrupted (SIGTERM); previous artifacts left as they were"
    finally:
        interrupts.reset()


# A signal inside a native call surfaces as that call's own error, its cause the handler's
# KeyboardInterrupt, both seen in CI at the moments above: during a stage (matplotlib's savefig:
# pybind11 turned it into "TypeError: incompatible function arguments") and during onnxruntime's
# import ("ImportError: initialization failed"). One line, exit 2, no traceback; without a signal
# the error is not hidden.
@pytest.mark.parametrize("patched, entry, error", [
    ("run_stages", lambda cli: cli._task(None), TypeError("affine_transform(): incompatible function arguments")),
    ("_main", lambda cli: cli.main(), ImportError("initialization failed")),
], ids=["in-a-stage", "in-a-native-import"])
def test_a_signal_a_native_call_turned_into_its_own_error_is_one_line(monkeypatch, capsys, patched, entry, error):
    import pipeline.__main__ as cli
    from pipeline import interrupts

    def signalled(*_):
        try:
            interrupts._handler(signal.SIGTERM, None)
        except KeyboardInterrupt as exc:
            raise error from exc

    def unsignalled(*_):
        raise type(error)("no signal: a real error")

    def leave(code):
        raise SystemExit(code)

    monkeypatch.setattr(cli.os, "_exit", leave)
    interrupts.reset()
    try:
        monkeypatch.setattr(cli, patched, signalled)
        with pytest.raises(SystemExit) as stop:
            entry(cli)
        assert stop.value.code == 2
        assert capsys.readouterr().err == "error: interrupted (SIGTERM); previous artifacts left as they were\n"
        interrupts.reset()
        monkeypatch.setattr(cli, patched, unsignalled)
        with pytest.raises(type(error), match="a real error"):
            entry(cli)
    finally:
        interrupts.reset()
        signal.signal(signal.SIGINT, signal.default_int_handler)


def ends_interrupted(script: str, signal_name: str) -> None:
    """``python -c script`` (it calls ``pipeline.__main__.main``) ends as an interrupted run: exit 2, its last
    line the interrupted one, no traceback."""
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MPLBACKEND": "Agg"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"error: interrupted ({signal_name}); previous artifacts left as they were", proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_a_signal_inside_hydras_own_start_up_is_one_line(tmp_path):
    """A signal while Hydra composes the run's config (after the command line's own check composed it
    once) is recorded, and raised as the run starts (pipeline.hydra_hooks): one line, exit 2, no Hydra
    traceback. Seen in CI: a SIGINT half a run in landed there on a loaded machine, OmegaConf turned it into
    its own error, and Hydra printed that error's traceback before the run's line."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        import hydra._internal.hydra as internal
        from pipeline.__main__ import main
        compose, calls = internal.Hydra.compose_config, []

        def signalled(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 2:  # the first is the command line's check, the second Hydra's own
                try:  # OmegaConf turns the handler's KeyboardInterrupt into an error of its own (seen in CI)
                    os.kill(os.getpid(), signal.SIGINT)
                except KeyboardInterrupt as exc:
                    raise ValueError("object_type=RuntimeConf") from exc
            return compose(self, *args, **kwargs)

        internal.Hydra.compose_config = signalled
        sys.argv = ["pipeline", "stage=evaluate", "eval.limit=1", "artifacts.dir={tmp_path / 'a'}"]
        main()
    """)
    ends_interrupted(script, "SIGINT")
    assert not (tmp_path / "a" / "evaluate").exists()


@pytest.mark.slow
def test_a_sweeps_parent_waiting_on_its_jobs_ends_at_a_signal_in_one_line(tmp_path):
    """Hydra's start-up is shielded (above), the sweep is not: a SIGTERM to a multirun's parent while the
    joblib launcher waits on its jobs ends the sweep there, in one line, exit 2 (it once waited for every
    job and exited 0). Here the launcher's joblib call signals its own process, then waits for its jobs."""
    marker = tmp_path / "waited"
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        import joblib
        from pipeline.__main__ import main

        def run_jobs(self, jobs):  # the joblib launcher's Parallel(...)(jobs): signalled while its jobs run
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(20)
            open({str(marker)!r}, "w").close()
            return []

        joblib.Parallel.__call__ = run_jobs
        sys.argv = ["pipeline", "-m", "stage=evaluate", "eval.limit=1,2", "artifacts.dir={tmp_path / 'a'}"]
        main()
    """)
    ends_interrupted(script, "SIGTERM")
    assert not marker.exists()  # the wait was cut, not sat out


def test_a_signal_during_the_swap_is_deferred_until_the_swap_is_done(tmp_path):
    from pipeline import interrupts
    from pipeline.errors import Interrupted

    interrupts.reset()
    try:
        with pytest.raises(Interrupted, match="while publishing"):
            with interrupts.publishing("demo"):
                interrupts._handler(signal.SIGTERM, None)  # recorded, not raised mid-swap
                (tmp_path / "swapped").write_text("done")
    finally:
        interrupts.reset()
    assert (tmp_path / "swapped").read_text() == "done"


def test_a_signal_after_a_publish_says_what_was_published(tmp_path):
    """A signal after a folder was swapped into place (the stage's last lines, or a later stage of
    stage=all) cannot say the previous artifacts were left as they were: the line names what is new."""
    from pipeline import interrupts
    from pipeline.artifacts import atomic_write_dir
    from pipeline.errors import Interrupted

    interrupts.reset()
    try:
        for name in ("first", "second"):
            with atomic_write_dir(tmp_path / name) as out:
                (out / "x.txt").write_text(name)
        interrupts._received.append(signal.SIGTERM)
        with pytest.raises(Interrupted) as stop:
            interrupts.check()
        assert str(stop.value) == (f"interrupted (SIGTERM); it had published 2 folders, the last {tmp_path / 'second'}; "
                                   "nothing else changed")
        interrupts._published.pop()
        assert interrupts.message() == f"interrupted (SIGTERM); it had published {tmp_path / 'first'}; nothing else changed"
        interrupts.install()  # a new run in this process: the earlier run's publishes are not its own
        assert interrupts.message() == "interrupted (SIGTERM); previous artifacts left as they were"
    finally:
        interrupts.reset()
        interrupts.finished()
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _publish_many(root: str, tag: str, n: int) -> None:
    from pipeline.artifacts import stage_output

    for i in range(n):
        with stage_output(Path(root), "demo", {"tag": tag, "i": i}, {}, force=True) as out:
            (out.path / "who.txt").write_text(f"{tag}{i}")


def test_two_writers_publishing_into_one_folder_both_succeed_and_leave_nothing_behind(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_publish_many, args=(str(tmp_path), tag, 40)) for tag in "ab"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]
    assert (tmp_path / "demo" / "who.txt").read_text() in {"a39", "b39"}


def _worker_handlers(_):
    return signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)


def test_pool_workers_leave_signals_to_the_parent():
    from pipeline import interrupts
    from pipeline.pools import process_pool

    saved = {sig: signal.getsignal(sig) for sig in interrupts.SIGNALS}
    interrupts.install()  # the CLI's handler in the parent: the workers must not keep it
    try:
        with process_pool(2) as pool:
            got = pool.map(_worker_handlers, range(2))
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert got == [(signal.SIG_IGN, signal.SIG_DFL)] * 2


# ---- 2. bad files --------------------------------------------------------------------------------
def _latin1(path: Path) -> Path:
    path.write_bytes("x^2\n\\alpha + é\n".encode("latin-1"))
    return path


@pytest.mark.slow
def test_non_utf8_formulas_files_are_one_line_naming_the_key_and_the_line(work, tmp_path):
    bad = _latin1(tmp_path / "latin1.txt")
    art = tmp_path / "a"
    one_error(run_cli(*EXPORT_ARGS, f"export.model={work / 'tiny'}", f"export.formulas={bad}", f"artifacts.dir={art}"),
              "export.formulas", "not UTF-8", "line 2")
    one_error(run_cli("stage=evaluate", f"eval.model={work / 'tiny'}", f"eval.formulas={bad}", f"artifacts.dir={art}",
                      "model.max_length=16"), "eval.formulas", "not UTF-8")
    one_error(run_cli("stage=benchmark", f"+benchmark.packages.pkg={work / 'art' / 'export-ort_cpu'}",
                      f"benchmark.model={work / 'tiny'}", f"benchmark.formulas={bad}", "model.max_length=16",
                      f"artifacts.dir={art}"), "benchmark.formulas", "not UTF-8")
    labels = tmp_path / "labels.tsv"
    labels.write_bytes("f0.png\t\\alpha \xe9\n".encode("latin-1"))
    one_error(run_cli("stage=evaluate", f"eval.model={work / 'tiny'}", f"eval.images={work / 'images'}",
                      f"eval.labels={labels}", "model.max_length=16", f"artifacts.dir={art}"), "eval.labels", "not UTF-8")
    assert not list(art.glob("[!.]*"))  # no stage folder


@pytest.mark.parametrize("edit, needles", [
    (lambda m: "{not json", ["package.json", "not JSON"]),
    (lambda m: json.dumps({**m, "graphs": list(m["graphs"].values())}), ["'graphs' must be an object"]),
    (lambda m: json.dumps({**m, "bos_id": "one"}), ["'bos_id' must be an integer", '"one"']),
    (lambda m: json.dumps({**m, "graphs": {**m["graphs"], "encoder": "../../x.onnx"}}), ["'graphs.encoder'"]),
    (lambda m: json.dumps([m]), ["must be a JSON object"]),
    (lambda m: json.dumps({k: v for k, v in m.items() if k != "num_layers"}), ["'num_layers' is missing"]),
])
def test_a_broken_package_json_names_the_field(work, tmp_path, edit, needles):
    from pipeline.errors import SchemaError
    from pipeline.export.runtime import OnnxPackage

    pkg = copy_package(work, tmp_path / "pkg")
    meta = json.loads((pkg / "package.json").read_text())
    (pkg / "package.json").write_text(edit(meta))
    with pytest.raises(SchemaError) as err:
        OnnxPackage(pkg)
    assert all(n in str(err.value) for n in needles), str(err.value)


@pytest.mark.slow
def test_a_broken_package_is_one_line_through_the_cli(work, tmp_path):
    pkg = copy_package(work, tmp_path / "pkg")
    (pkg / "package.json").write_text('{"graphs": ')
    one_error(run_cli("stage=infer", f"infer.package={pkg}", f"infer.image={work / 'images'}", f"artifacts.dir={tmp_path / 'a'}"),
              f"package.json in {pkg}: not JSON")
    (pkg / "package.json").write_text(json.dumps({**json.loads((work / "art" / "export-ort_cpu" / "package.json")
                                                               .read_text()), "bos_id": "one"}))
    (pkg / "tokenizer.json").write_text("garbage")
    one_error(run_cli("stage=infer", f"infer.package={pkg}", f"infer.image={work / 'images'}", f"artifacts.dir={tmp_path / 'a'}"),
              "'bos_id' must be an integer")


@pytest.mark.parametrize("content, needles", [
    (b"\x00\xffgarbage", ["tokenizer.json", "not UTF-8"]),
    (b'{"token_to_id": [], "specials": {}}', ["'token_to_id' must be an object"]),
    (b'{"token_to_id": {"a": 0}, "specials": {"pad": "a", "bos": "a", "eos": "a", "unk": "?"}}',
     ["'specials' names tokens not in 'token_to_id'", "unk='?'"]),
])
def test_a_broken_package_tokenizer_names_the_field(work, tmp_path, content, needles):
    from pipeline.errors import SchemaError
    from pipeline.export.runtime import OnnxPackage

    pkg = copy_package(work, tmp_path / "pkg")
    (pkg / "tokenizer.json").write_bytes(content)
    with pytest.raises(SchemaError) as err:
        OnnxPackage(pkg)
    assert all(n in str(err.value) for n in needles), str(err.value)


def _model_copy(work: Path, dest: Path, edit=None, drop: str | None = None) -> Path:
    shutil.copytree(work / "tiny", dest)
    if drop:
        (dest / drop).unlink()
    if edit:
        meta = json.loads((dest / "config.json").read_text())
        edit(meta)
        (dest / "config.json").write_text(json.dumps(meta))
    return dest


@pytest.mark.parametrize("case, needles", [
    ("no_tokenizer", ["tokenizer.json is missing"]),
    ("zero_heads", ["'model_config.num_heads' must be an integer >= 1, got 0"]),
    ("zero_encoder_heads", ["'encoder_heads[1]' must be an integer >= 1, got 0"]),
    ("heads_do_not_divide", ["does not divide"]),
    ("garbage_tokenizer", ["tokenizer.json", "not JSON"]),
])
@pytest.mark.slow
def test_a_broken_model_folder_names_the_field(work, tmp_path, case, needles):
    edits = {
        "zero_heads": lambda m: m["model_config"].update(num_heads=0),
        "zero_encoder_heads": lambda m: m.update(encoder_heads=[4, 0]),
        "heads_do_not_divide": lambda m: m["model_config"].update(num_heads=5),
    }
    model = _model_copy(work, tmp_path / "m", edits.get(case), "tokenizer.json" if case == "no_tokenizer" else None)
    if case == "garbage_tokenizer":
        (model / "tokenizer.json").write_text("{ nope")
    if case == "no_tokenizer":  # one case through the CLI: the stage loads the model and says one line
        one_error(run_cli("stage=evaluate", f"eval.model={model}", f"eval.formulas={work / 'formulas.txt'}",
                          "model.max_length=16", f"artifacts.dir={tmp_path / 'a'}"), *needles)
        return
    from pipeline.adapters import load_adapter
    from pipeline.errors import SchemaError

    with pytest.raises(SchemaError) as err:
        load_adapter("latex_ocr_junia", str(model))
    assert all(n in str(err.value) for n in needles), str(err.value)


@pytest.mark.parametrize("script", ["encoder_tokens", "verify_deviation", "int8_precision"])
def test_a_benchmark_given_no_package_says_which_in_one_line(tmp_path, capsys, script):
    """The benchmark scripts find their packages with pipeline.files.find_package: a ref that is neither a
    package folder nor an export stage under the root is one line and exit 2."""
    import importlib.util

    from conftest import REPO

    (tmp_path / "export-ort_cpu").mkdir()
    (tmp_path / "export-ort_cpu" / "package.json").write_text("{}")
    spec = importlib.util.spec_from_file_location(script, REPO / "benchmarks" / f"{script}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(tmp_path), "export-ort_cpu", "nowhere"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: packages=nowhere: not an exported package folder") and "\n" not in err


# ---- 3. hostile images ---------------------------------------------------------------------------
def test_open_image_refuses_a_bomb_from_its_header(bomb):
    from pipeline.errors import ImageError
    from pipeline.files import open_image

    with pytest.raises(ImageError, match="bomb.png: 400,000,000 pixels is above the 50,000,000-pixel limit"):
        open_image(bomb)


@pytest.mark.slow
def test_a_bomb_among_images_is_skipped_and_named_alone_it_is_one_line(work, bomb, tmp_path):
    folder = tmp_path / "imgs"
    shutil.copytree(work / "images", folder)
    shutil.copy(bomb, folder / "bomb.png")
    (folder / "labels.tsv").write_text("f0.png\tx^2\nbomb.png\ty\n")
    common = [f"eval.model={work / 'tiny'}", "model.max_length=16", "eval.image_match=false",
              "eval.latency_samples=0", "progress=false"]
    ok = run_cli("stage=evaluate", f"eval.images={folder}", *common, f"artifacts.dir={tmp_path / 'a'}")
    assert ok.returncode == 0 and "Traceback" not in ok.stderr, ok.stderr[-3000:]
    assert "WARNING: [evaluate] skipped 1 unreadable image(s): bomb.png: 400,000,000 pixels is above" in ok.stderr
    (folder / "labels.tsv").write_text("bomb.png\ty\n")
    one_error(run_cli("stage=evaluate", f"eval.images={folder}", *common, f"artifacts.dir={tmp_path / 'b'}"),
              "bomb.png", "pixel limit")

    pkg = work / "art" / "export-ort_cpu"
    ok = run_cli("stage=infer", f"infer.package={pkg}", f"infer.image={folder}", f"artifacts.dir={tmp_path / 'c'}")
    assert ok.returncode == 0 and "Traceback" not in ok.stderr, ok.stderr[-3000:]
    assert "bomb.png: 400,000,000 pixels is above" in ok.stderr and ok.stdout.count("\t") == 2  # f0, f1 read
    one_error(run_cli("stage=infer", f"infer.package={pkg}", f"infer.image={folder / 'bomb.png'}", f"artifacts.dir={tmp_path / 'c'}"),
              "bomb.png", "pixel limit")


# ---- 4. numbers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("override, needle", [
    ("model.max_length=0", "model.max_length=0: must be >= 2"),
    ("model.max_length=1", "model.max_length=1: must be >= 2"),
    ("model.batch_size=0", "model.batch_size=0: must be >= 1"),
    ("model.threads=-1", "model.threads=-1: must be >= 0"),
    ("model.layout_run_cap=-1", "model.layout_run_cap=-1: must be >= 0"),
])
def test_numbers_out_of_range_are_refused_at_config_time(tmp_path, override, needle):
    from omegaconf import OmegaConf

    from conftest import compose_cfg
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(needle)):
        OmegaConf.to_object(compose_cfg([override, f"artifacts.dir={tmp_path / 'a'}"]))


@pytest.mark.slow
def test_a_number_out_of_range_is_one_config_line_and_writes_nothing(tmp_path):
    one_error(run_cli("stage=evaluate", "model.batch_size=0", f"artifacts.dir={tmp_path / 'a'}"),
              "error: config: model.batch_size=0: must be >= 1")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("override, stage, needle", [
    ("prune.ratio=1.5", "prune", "prune.ratio must be in [0, 1)"),
    ("tokenizer.vocab_size=2", "tokenizer", "tokenizer.vocab_size"),
    ("calibrate.size=0", "calibrate", "calibrate.size must be"),
    ("quantize.budget=2", "quantize", "quantize.budget must be in [0, 1)"),
    ("export.parity_images=0", "export", "export.parity_images must be >= 1, got 0"),
    ("export.parity_limit=0", "export", "export.parity_limit must be >= 1 or null, got 0"),
    ("benchmark.samples=0", "benchmark", "benchmark.samples must be >= 1"),
])
def test_every_stage_of_the_chain_checks_its_keys_before_the_first_one_runs(tmp_path, override, stage, needle):
    """stage=all: a bad key of any stage (the last one's included) fails before prune starts, naming
    the stage; nothing is written."""
    from conftest import compose_cfg
    from pipeline.__main__ import run_stages
    from pipeline.errors import PipelineError

    cfg = compose_cfg(["stage=all", override, f"artifacts.dir={tmp_path / 'a'}"])
    with pytest.raises(PipelineError, match=re.escape(f"stage=all, stage {stage}: {needle}")):
        run_stages(cfg)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("stage", ["all", "calibrate", "quantize"])
def test_the_data_groups_source_is_checked_before_the_first_stage_runs(tmp_path, stage):
    """calibrate opens the data group after prune's minutes under stage=all: an unknown kind, a missing or
    absent path and a labels file that is not there fail before any stage, each in one line."""
    from conftest import compose_cfg
    from pipeline.__main__ import run_stages
    from pipeline.errors import ConfigError

    images = tmp_path / "images"
    images.mkdir()
    for overrides, needle in ((["data=image_folder"], "data.path is required for data=image_folder"),
                              (["data=hf_disk", f"data.path={tmp_path / 'nowhere'}"], "nowhere does not exist"),
                              (["data=image_folder", f"data.path={images}", f"data.labels={tmp_path / 'l.tsv'}"],
                               f"data.labels: no such file {tmp_path / 'l.tsv'}")):
        cfg = compose_cfg([f"stage={stage}", *overrides, f"artifacts.dir={tmp_path / 'a'}"])
        with pytest.raises(ConfigError, match=re.escape(needle)):
            run_stages(cfg)
    assert not (tmp_path / "a").exists()


@pytest.mark.slow
def test_a_model_key_naming_nothing_fails_before_the_first_stage(tmp_path):
    """quantize.model=prnue under stage=all: one line before prune starts; a stage's name, an artifact's
    name (prune.name=...), auto, original and a folder pass the check."""
    from conftest import compose_cfg
    from pipeline.__main__ import check_model_refs
    from pipeline.errors import ConfigError

    root = tmp_path / "a"
    for override in ("quantize.model=prnue", f"export.model={tmp_path / 'nowhere'}", "benchmark.model=none"):
        with pytest.raises(ConfigError, match=re.escape(f"{override.split('=')[0]}={override.split('=')[1]!r}: not "
                                                        f"original or auto, not a stage or an artifact under {root}")):
            check_model_refs(compose_cfg(["stage=all", override, f"artifacts.dir={root}"]))
    for overrides in (["quantize.model=prune"], ["prune.name=mine", "quantize.model=mine"], ["export.model=auto"],
                      ["benchmark.model=original"], [f"prune.model={tmp_path}"], ["stage=evaluate", "quantize.model=x"]):
        check_model_refs(compose_cfg(["stage=all", *overrides, f"artifacts.dir={root}"]))
    one_error(run_cli("stage=all", "quantize.model=prnue", f"artifacts.dir={root}"), "quantize.model='prnue'")
    assert not root.exists()  # refused before Hydra's own record of the run


@pytest.mark.slow
def test_a_bad_key_of_the_chains_fifth_stage_is_one_line_in_seconds(tmp_path):
    one_error(run_cli("stage=all", "quantize.budget=2", f"artifacts.dir={tmp_path / 'a'}"),
              "error: stage=all, stage quantize: quantize.budget must be in [0, 1)")
    assert [p.name for p in (tmp_path / "a").iterdir()] == [".hydra"]  # Hydra's record of the run, no stage's output


@pytest.mark.slow
def test_a_cap_above_the_models_position_table_is_refused_with_its_limit(work, tmp_path):
    one_error(run_cli("stage=evaluate", f"eval.model={work / 'tiny'}", f"eval.formulas={work / 'formulas.txt'}",
                      f"model.max_length={TINY_MAX_POSITIONS + 1}", f"artifacts.dir={tmp_path / 'a'}"),
              f"model.max_length={TINY_MAX_POSITIONS + 1}", f"above the {TINY_MAX_POSITIONS} positions")
    pkg = work / "art" / "export-ort_cpu"
    one_error(run_cli("stage=infer", f"infer.package={pkg}", f"infer.image={work / 'images'}", "infer.max_length=1000",
                      f"artifacts.dir={tmp_path / 'a'}"), "infer.max_length=1000", f"{TINY_MAX_POSITIONS} positions")
    one_error(run_cli("stage=infer", f"infer.package={pkg}", f"infer.image={work / 'images'}", "infer.threads=-1",
                      f"artifacts.dir={tmp_path / 'a'}"), "infer.threads")


# ---- 5. paths ------------------------------------------------------------------------------------
@pytest.mark.parametrize("override", ["eval.name=../escape", "eval.name=.", "eval.name=..", "export.name=a/b",
                                      "eval.name="])
def test_names_are_one_folder_name(tmp_path, override):
    from conftest import compose_cfg
    from pipeline.__main__ import check_config
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="a name must be one folder name"):
        check_config(compose_cfg([override, f"artifacts.dir={tmp_path / 'a'}"]))


@pytest.mark.slow
def test_a_name_outside_the_root_is_one_line_and_writes_nothing(tmp_path):
    art = tmp_path / "inside" / "a"
    one_error(run_cli("stage=evaluate", "eval.name=../escape", f"artifacts.dir={art}"),
              "eval.name='../escape': a name must be one folder name")
    assert not (tmp_path / "inside").exists() and not (tmp_path / "escape").exists()


@pytest.mark.slow
def test_artifacts_dir_on_a_file_is_one_line(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    one_error(run_cli("stage=evaluate", f"artifacts.dir={afile}"), "artifacts.dir", "is a file")
    one_error(run_cli("stage=evaluate", f"artifacts.dir={afile / 'sub'}"), "artifacts.dir", "is a file")
    assert afile.read_text() == "x"


@pytest.mark.slow
def test_infer_output_into_a_missing_folder_is_refused_before_the_work(work, tmp_path):
    proc = run_cli("stage=infer", f"infer.package={work / 'art' / 'export-ort_cpu'}", f"infer.image={work / 'images'}",
                   f"infer.output={tmp_path / 'missing' / 'out.tsv'}", f"artifacts.dir={tmp_path / 'a'}")
    one_error(proc, "infer.output", "does not exist")
    assert "\t" not in proc.stdout  # refused before anything was read


# ---- 6. the data group ---------------------------------------------------------------------------
@pytest.mark.parametrize("stage, own", [("evaluate", "eval.images=DIR"), ("export", "export.formulas=FILE"),
                                        ("benchmark", "benchmark.formulas=FILE"), ("infer", "infer.image="),
                                        ("tokenizer", "")])
def test_a_stage_that_does_not_read_the_data_group_refuses_it(tmp_path, stage, own):
    from conftest import compose_cfg
    from pipeline.__main__ import check_config
    from pipeline.errors import ConfigError

    cfg = compose_cfg([f"stage={stage}", "data=image_folder", f"data.path={tmp_path}", f"artifacts.dir={tmp_path / 'a'}"])
    with pytest.raises(ConfigError, match=f"data=image_folder: stage {stage} does not read the data group") as err:
        check_config(cfg)
    assert own in str(err.value)
    for ok in ("calibrate", "quantize", "all"):  # these hand the group on (quantize through calibrate's set)
        check_config(compose_cfg([f"stage={ok}", "data=image_folder", f"data.path={tmp_path}",
                                  f"artifacts.dir={tmp_path / 'a'}"]))


@pytest.mark.slow
def test_evaluate_with_an_image_folder_data_group_is_one_line_not_the_corpus(tmp_path):
    one_error(run_cli("stage=evaluate", "data=image_folder", f"data.path={tmp_path}", f"artifacts.dir={tmp_path / 'a'}"),
              "error: config: data=image_folder: stage evaluate does not read the data group", "eval.images=DIR")
    assert not (tmp_path / "a").exists()


@pytest.mark.slow
def test_infer_options_live_under_infer(tmp_path):
    one_error(run_cli("stage=infer", f"artifacts.dir={tmp_path / 'a'}"), "infer.package is not set")
    one_error(run_cli("stage=infer", f"package={tmp_path}", f"artifacts.dir={tmp_path / 'a'}"), "error: config:", "package")


@pytest.mark.slow
def test_a_failed_export_keeps_its_parity_report_where_the_error_says(work, tmp_path):
    art = tmp_path / "a"
    base = [*EXPORT_ARGS, f"export.model={work / 'tiny'}", f"export.formulas={work / 'formulas.txt'}",
            f"artifacts.dir={art}"]
    line = one_error(run_cli(*base, "export.min_snr_db=1000"), "parity beyond tolerance for ort_cpu", "SNR")
    kept = art / "failed" / "export-ort_cpu"
    assert f"report kept in {kept}" in line
    report = json.loads((kept / "parity.json").read_text())
    assert report["failures"] and report["tolerances"]["min_snr_db"] == 1000 and report["tensors"]
    assert not (art / "export-ort_cpu").exists()  # the package itself is not published
    ok = run_cli(*base)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (art / "export-ort_cpu" / "parity.json").is_file() and not kept.exists()  # the stale report goes


def test_one_labels_file_lookup_for_evaluate_and_calibrate(tmp_path):
    from calibration.sets import ImageFolderSource
    from pipeline import files
    from pipeline.errors import InputError

    folder = tmp_path / "imgs"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"")
    assert files.labels_file(folder, None, "data.labels") is None  # unlabelled: calibrate buckets by image
    with pytest.raises(InputError, match=re.escape(f"eval.labels is not set and {folder / 'labels.tsv'} does not exist")):
        files.labels_file(folder, None, "eval.labels", required=True)
    with pytest.raises(InputError, match=re.escape(f"data.labels: no such file {tmp_path / 'x.tsv'}")):
        ImageFolderSource(folder, tmp_path / "x.tsv")
    (folder / "labels.tsv").write_text("a.png\tx^2\n")
    assert files.labels_file(folder, None, "eval.labels", required=True) == folder / "labels.tsv"
    assert ImageFolderSource(folder).labels == {"a.png": "x^2"}


# ---- 6. targets --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_target_overrides_reach_their_target_under_export_targets_or_fail_in_one_line(tmp_path):
    """With export.targets (stage=all), target.* overrides belong to the composed target group's target:
    that target's package gets them, the others their YAML; a target the list leaves out is refused."""
    from conftest import compose_cfg
    from pipeline.export.targets import resolve_target, target_configs

    cfg = compose_cfg(["stage=all", "target=metax", "target.max_ir_version=7", f"artifacts.dir={tmp_path / 'a'}"])
    made = target_configs(list(cfg.export.targets), cfg.target)
    assert list(made) == ["ort_cpu", "metax", "tensorrt"]
    assert made["metax"].max_ir_version == 7 and made["tensorrt"].max_ir_version is None
    assert resolve_target(made["metax"]).rules.max_ir_version == 7
    one_error(run_cli("stage=all", "target=metax", "target.max_ir_version=7", "export.targets=[ort_cpu,tensorrt]",
                      f"artifacts.dir={tmp_path / 'b'}"),
              "target.max_ir_version is set for target metax, which export.targets=[ort_cpu,tensorrt] does not export")


def test_each_targets_rules_are_its_yamls():
    """The validator's rules come from conf/target/<name>.yaml, not from the target's name."""
    from conftest import compose_cfg
    from pipeline.export.targets import resolve_target, target_config
    from pipeline.export.validator import FLOAT_ONLY_OPS

    metax, trt, cpu = (resolve_target(target_config(n)).rules for n in ("metax", "tensorrt", "ort_cpu"))
    assert (metax.symmetric_int8, metax.per_channel_weights, metax.per_tensor_activations) == (True, True, True)
    assert metax.float_only_ops == FLOAT_ONLY_OPS and metax.max_ir_version == 8 and not metax.allow_contrib_ops
    assert trt.symmetric_int8 and not trt.per_channel_weights and trt.float_only_ops == ()
    assert not cpu.symmetric_int8 and cpu.allow_contrib_ops
    cfg = compose_cfg(["target=tensorrt", "target.per_channel_weights=true"])
    assert resolve_target(cfg.target).rules.per_channel_weights


@pytest.mark.slow
def test_a_targets_drafter_defaults_are_its_yamls_and_a_bad_one_fails_before_the_chain(tmp_path):
    """A verify call on a CPU costs more per token it checks, on a GPU about the same whatever its width:
    each target's YAML says how its packages' ngram drafter drafts. A bad value under stage=all is one
    line before prune's work, like a stage's bad key."""
    from pipeline.export.targets import resolve_target, target_config

    cpu, trt, metax = (resolve_target(target_config(n)) for n in ("ort_cpu", "tensorrt", "metax"))
    assert (cpu.draft_min_confidence, cpu.draft_tail) == (0.7, 1)
    assert (trt.draft_min_confidence, trt.draft_tail) == (metax.draft_min_confidence, metax.draft_tail) == (0.0, 0)
    # and how a batch of several images decodes: image by image speculatively on a CPU, greedy steps on a GPU
    assert cpu.speculative_batches and not trt.speculative_batches and not metax.speculative_batches
    one_error(run_cli("stage=all", "target=metax", "target.draft_tail=-2", f"artifacts.dir={tmp_path / 'a'}"),
              "error: config: target.draft_tail must be >= 0, got -2")
    assert not (tmp_path / "a").exists()  # nothing written
    one_error(run_cli("stage=export", "target.draft_min_confidence=2", f"artifacts.dir={tmp_path / 'b'}"),
              "target.draft_min_confidence must be in [0, 1], got 2")
