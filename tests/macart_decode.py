"""Greedy decoding of an exported package with numpy and onnxruntime alone (no torch, no ``pipeline``).

It runs in the ONNX Runtime 1.12.1 venv of ``tests/macart_env.py`` (MacaRT forks ORT 1.12), so it
must stay importable on Python 3.10 with numpy 1.26. It decodes with the loops of
``pipeline/decoding.py`` (loaded by file path: it imports nothing of the project), as
``pipeline.export.runtime.OnnxPackage`` does: ``decoder_first(BOS, memory)``, then one ``decoder_step``
per token with the present K/V fed back as past (``cached_greedy``), pad and BOS banned, the package's
cap on layout-only runs, finished rows leave the batch, the cap counts BOS.

    python macart_decode.py PACKAGE IMAGES.npy OUT.json [--max-length N] [--batch-size B] [--threads T]
                                                        [--speculative]

``--speculative``: where the package has a drafter, each image (batch 1) is read with
``speculative_greedy`` of ``pipeline/decoding.py`` through ``decoder_verify.onnx`` and the drafter of
``pipeline/drafting.py`` (both loaded by file path): the same sequences in fewer decoder calls.

IMAGES.npy holds preprocessed images, float32 [N, C, H, W]. OUT.json gets
``{"onnxruntime": version, "provider": ..., "max_length": N, "sequences": [[token ids], ...]}``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

PROVIDER = "CPUExecutionProvider"
DECODING = Path(__file__).resolve().parent.parent / "pipeline" / "decoding.py"
DRAFTING = Path(__file__).resolve().parent.parent / "pipeline" / "drafting.py"


def by_path(path: Path, name: str):
    """A module of the project that imports nothing of it, loaded from its file (once)."""
    import importlib.util

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before it runs: a dataclass looks its module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def decoding():
    """``pipeline/decoding.py`` without importing the project."""
    return by_path(DECODING, "formula_compress_decoding")


def token_texts(tokenizer_json: dict, vocab_size: int) -> list:
    """What each token id writes: the char vocabulary's ``token_to_id`` (specials write nothing), or
    the formula BPE's vocabulary and added tokens (a Fuse decoder: the pieces concatenated)."""
    texts = [""] * vocab_size
    if "token_to_id" in tokenizer_json:
        specials = set(tokenizer_json["specials"].values())
        for tok, i in tokenizer_json["token_to_id"].items():
            if int(i) < vocab_size and tok not in specials:
                texts[int(i)] = tok
        return texts
    for tok, i in tokenizer_json["model"]["vocab"].items():
        if int(i) < vocab_size:
            texts[int(i)] = tok
    for added in tokenizer_json.get("added_tokens", []):
        if int(added["id"]) < vocab_size:
            texts[int(added["id"])] = "" if added.get("special", False) else added["content"]
    return texts


class Package:
    """The three graphs of a package folder and the decoding facts of its ``package.json``."""

    def __init__(self, folder: Path, threads: int = 0):
        self.meta = json.loads((folder / "package.json").read_text())
        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads = threads
            so.inter_op_num_threads = 1
        so.log_severity_level = 3
        self.sessions = {g: ort.InferenceSession(str(folder / self.meta["graphs"][g]), so, providers=[PROVIDER])
                         for g in ("encoder", "decoder_first", "decoder_step")}
        self.folder, self.options = folder, so
        self.io = self.meta["io"]
        self.bos, self.eos = int(self.meta["bos_id"]), int(self.meta["eos_id"])
        self.banned = [int(i) for i in self.meta["banned_token_ids"]]
        self.num_layers = int(self.meta["num_layers"])
        self.layout_run_cap = int(self.meta.get("layout_run_cap", 0))
        self.tokenizer_json = json.loads((folder / self.meta.get("tokenizer", {}).get("file", "tokenizer.json")).read_text())
        self.guard = None

    def layout_guard(self, vocab_size: int):
        if self.guard is None or len(self.guard.texts) != vocab_size:
            texts = token_texts(self.tokenizer_json, vocab_size)
            self.guard = decoding().LayoutGuard.for_vocabulary(texts.__getitem__, vocab_size, self.eos,
                                                             self.layout_run_cap)
        return self.guard

    def encode(self, images: np.ndarray) -> np.ndarray:
        io = self.io["encoder"]
        return self.sessions["encoder"].run([io["outputs"][0]], {io["inputs"][0]: images.astype(np.float32)})[0]

    def first(self, input_ids: np.ndarray, memory: np.ndarray):
        names = self.io["decoder_first"]["inputs"]
        outs = self.sessions["decoder_first"].run(None, dict(zip(names, [input_ids.astype(np.int64), memory])))
        n = 2 * self.num_layers
        return outs[0], outs[1:1 + n], outs[1 + n:]

    def step(self, input_ids: np.ndarray, past: list, cross: list):
        names = self.io["decoder_step"]["inputs"]
        outs = self.sessions["decoder_step"].run(None, dict(zip(names, [input_ids.astype(np.int64), *past, *cross])))
        return outs[0], outs[1:]

    def speculative(self, memory: np.ndarray, max_length: int, stats=None) -> list:
        """One image's reading with ``decoder_verify`` and the package's drafter (``OnnxPackage._speculative``)."""
        drafting = by_path(DRAFTING, "formula_compress_drafting")
        folder = self.folder
        if "verify" not in self.sessions:
            self.sessions["verify"] = ort.InferenceSession(str(folder / self.meta["graphs"]["decoder_verify"]),
                                                           self.options, providers=[PROVIDER])
        vocab = self.sessions["decoder_step"].get_outputs()[0].shape[-1]
        drafter, draft_len = drafting.load(  # a student drafter's graphs: sessions like the package's
            folder / self.meta["drafter"], token_texts(self.tokenizer_json, vocab),
            open_reader=lambda entry: decoding().StudentReader.from_entry(
                entry, lambda name: ort.InferenceSession(str(folder / name), self.options, providers=[PROVIDER])))
        if hasattr(drafter, "begin"):  # the student reads the image first
            calls = drafter.begin(memory)
            if stats is not None:
                stats.drafter_calls += calls
        names = self.io["decoder_verify"]["inputs"]

        def run(ids, past, cross):
            feed = dict(zip(names, [ids.astype(np.int64), *(np.ascontiguousarray(p) for p in past), *cross]))
            outs = self.sessions["verify"].run(None, feed)
            return outs[0], outs[1:]

        width = self.sessions["verify"].get_inputs()[0].shape[-1]
        fixed = isinstance(width, int)  # dynamic: up to package.json's verify_width tokens a call
        positions = int(self.meta.get("max_positions", self.meta["max_length"]))
        verify = decoding().VerifyCalls(run, self.step, width if fixed else int(self.meta["verify_width"]), positions,
                                      fixed)

        guard = self.layout_guard(vocab) if self.layout_run_cap else None
        return decoding().speculative_greedy(lambda ids: self.first(ids, memory), verify, drafter.propose, self.bos,
                                           self.eos, self.banned, max_length, draft_len, guard, stats,
                                           verify.free_drafts)

    def greedy(self, memory: np.ndarray, max_length: int) -> list:
        """``OnnxPackage._greedy``: the same loop (``cached_greedy``) on this venv's sessions."""
        vocab = self.sessions["decoder_step"].get_outputs()[0].shape[-1]
        guard = self.layout_guard(vocab) if self.layout_run_cap else None
        return decoding().cached_greedy(lambda ids: self.first(ids, memory), self.step, memory.shape[0], self.bos,
                                        self.eos, self.banned, max_length, guard)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("package", type=Path)
    ap.add_argument("images", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--max-length", type=int, default=None, help="cap incl. BOS; default: the package's")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--speculative", action="store_true", help="batch 1 with the package's drafter")
    args = ap.parse_args(argv)
    if not (args.package / "package.json").is_file():
        print(f"error: not an exported package (no package.json): {args.package}", file=sys.stderr)
        return 2
    pkg = Package(args.package, args.threads)
    images = np.load(args.images)
    max_length = int(args.max_length or pkg.meta["max_length"])
    sequences = []
    stats = None
    if args.speculative:
        if not pkg.meta.get("drafter"):
            print(f"error: --speculative: package {args.package} has no drafter", file=sys.stderr)
            return 2
        stats = decoding().SpeculativeStats()
        for image in images:
            sequences.append(pkg.speculative(pkg.encode(image[None]), max_length, stats))
    else:
        for start in range(0, images.shape[0], args.batch_size):
            sequences += pkg.greedy(pkg.encode(images[start:start + args.batch_size]), max_length)
    args.out.write_text(json.dumps({"onnxruntime": ort.__version__, "numpy": np.__version__, "provider": PROVIDER,
                                    "max_length": max_length, "sequences": sequences,
                                    "speculative": stats.as_dict() if stats else None}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
