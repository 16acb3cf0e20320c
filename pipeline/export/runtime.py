"""Read formulas with an exported package alone: ONNX Runtime sessions, the package's
preprocessing config and tokenizer, greedy decoding with the KV cache.

No torch model and no model weights are loaded here: everything comes from the package folder.
"""
from __future__ import annotations

import collections
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from PIL import Image

from pipeline import denormals, drafting, interrupts, schema
from pipeline.decoding import (DecodeResult, LayoutGuard, SpeculativeStats, StudentReader, VerifyCalls, cached_greedy,
                               speculative_greedy)
from pipeline.errors import PipelineError
from pipeline.names import (DECODER_FIRST, DECODER_STEP, DECODER_VERIFY, ENCODER, PACKAGE_META, PREPROCESS,
                            REQUIRED_GRAPHS, TOKENIZER)
from pipeline.preprocessing import preprocess
from pipeline.tokens.policy import grouped_batches, reading_batches
from pipeline.schema import load_json

log = logging.getLogger(__name__)


NO_SPINNING = "session.intra_op.allow_spinning"
# exact INT8 products on x86 CPUs without VNNI (AVX2, AVX-512 without VNNI): there ONNX Runtime's U8S8 kernel
# adds pairs of products in 16 bits (vpmaddubsw), which saturate, and the INT8 encoder and the dynamic INT8
# cross-K/V read wrong; "1" makes it use U8U8 on those CPUs and leaves VNNI CPUs as they are (docs/export.md)
PRECISE_INT8 = "session.x64quantprecision"

# package.json: format. v2: the encoder may take a "keep" input (package.json: token_policy), which a v1
# runtime would not feed; a package without a policy stays v1 (any runtime reads it)
FORMAT_V1 = "formula-compress onnx package v1"
FORMAT_V2 = "formula-compress onnx package v2"
FORMATS = (FORMAT_V1, FORMAT_V2)


def package_format(token_policy: bool) -> str:
    """The format a package is written in: v2 where its encoder reads a token policy's kept patches."""
    return FORMAT_V2 if token_policy else FORMAT_V1


def session_config(flush_denormals: bool = True) -> dict[str, str]:
    """The ONNX Runtime session config entries a package records (``package.json: session_config``) and
    every session of this project uses: denormals flushed to zero (:mod:`pipeline.denormals`) unless
    ``model.flush_denormals=false``, pools that do not spin between calls (a package runs its sessions
    in turn, each with a pool of its own; a spinning pool takes the cores the next session needs: 2 cores,
    ORT's default threads, batch 1: 115 ms a formula end to end spinning, 55 not; docs/export.md), and
    INT8 products that do not saturate on CPUs without VNNI (:data:`PRECISE_INT8`)."""
    return {denormals.SESSION_ENTRY: "1" if flush_denormals else "0", NO_SPINNING: "0", PRECISE_INT8: "1"}


def session_options(threads: int = 0, config: dict[str, str] | None = None):
    """ONNX Runtime session options: ``threads`` intra-op threads (0: ORT's default) and ``config``'s
    entries (default :func:`session_config`)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = int(threads)
        so.inter_op_num_threads = 1
    for key, value in (session_config() if config is None else config).items():
        so.add_session_config_entry(key, str(value))
    so.log_severity_level = 3
    return so


def preprocess_image(image: Image.Image, spec: dict) -> np.ndarray:
    """The model's inference preprocessing, from ``preprocess.json`` -> float32 [C, H, W]
    (any kind :mod:`pipeline.preprocessing` knows)."""
    return preprocess(image, spec)


class CharTokenizer:
    """``tokenizer.json`` (token_to_id + specials) read without the model package."""

    def __init__(self, path: Path):
        from pipeline.schema import load_char_tokenizer

        payload = load_char_tokenizer(Path(path))
        self.token_to_id = payload["token_to_id"]
        self.id_to_token = {int(i): t for t, i in self.token_to_id.items()}
        sp = payload["specials"]
        self.specials = {sp[k] for k in ("pad", "bos", "eos", "unk")}
        self.eos = sp["eos"]
        self.unk = sp["unk"]

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            tok = self.id_to_token.get(int(i), self.unk)
            if tok == self.eos:
                break
            if tok not in self.specials:
                out.append(tok)
        return "".join(out)


def _sniffed_tokenizer(path: Path, meta: dict | None = None):
    """The char vocabulary or the formula BPE, whichever the file is (packages from before
    ``package.json: tokenizer.kind``, and the two kinds export writes from the file itself)."""
    from pipeline.tokenization.bpe import BpeTokenizer, is_bpe_file

    return BpeTokenizer.from_file(path) if is_bpe_file(path) else CharTokenizer(path)


def _hf_tokenizer(path: Path, meta: dict):
    """Any HF ``tokenizers`` JSON, with the model's special ids from ``package.json``."""
    from pipeline.tokenization.hf import HfTokenizer

    return HfTokenizer(path, int(meta["bos_id"]), int(meta["eos_id"]),
                       None if meta.get("pad_id") is None else int(meta["pad_id"]))


# package.json: tokenizer.kind -> the loader of tokenizer.json. "char" and "bpe" read the file as it is
# (export names the kind from the file, so the two agree; the file decides, as before the kind existed).
TOKENIZER_KINDS: dict[str, Callable[[Path, dict], object]] = {
    "char": _sniffed_tokenizer, "bpe": _sniffed_tokenizer, "hf": _hf_tokenizer,
}


def package_tokenizer(path: Path, meta: dict | None = None):
    """The package's ``tokenizer.json`` by ``package.json: tokenizer.kind``: the model's char
    vocabulary, the formula BPE of a decoder from stage distill, or any HF tokenizer ("hf"); without
    a kind, the char vocabulary or the formula BPE, whichever the file is. All decode ids up to EOS."""
    kind = ((meta or {}).get("tokenizer") or {}).get("kind")
    if kind is None:
        return _sniffed_tokenizer(Path(path))
    if kind not in TOKENIZER_KINDS:
        raise PipelineError(f"{PACKAGE_META} in {Path(path).parent}: unsupported tokenizer kind {kind!r} "
                            f"(known kinds: {', '.join(sorted(TOKENIZER_KINDS))})")
    return TOKENIZER_KINDS[kind](Path(path), meta)


def batch_runs(n: int, batch_size: int, parts: int) -> list[tuple[int, int]]:
    """``n`` images cut into at most ``parts`` contiguous runs of whole batches: decoding the runs
    side by side decodes the very batches one pass over all ``n`` would (the same tokens)."""
    batches = -(-n // batch_size)
    per = max(1, -(-batches // max(1, parts))) * batch_size
    return [(i, min(i + per, n)) for i in range(0, n, per)] or [(0, 0)]


# where a package's provider is missing, or leaves nodes it cannot run: the next ones tried, before the CPU
PROVIDER_FALLBACKS = {"TensorrtExecutionProvider": ("CUDAExecutionProvider",)}


def provider_chain(wanted: str, available: list[str], options: dict) -> list:
    """ONNX Runtime's providers for a package made for ``wanted``: it (with ``options``) and its fallbacks
    (:data:`PROVIDER_FALLBACKS`, with ``device_id`` where given) where this onnxruntime has them, then the CPU.
    The CPU alone where none is here: the reference runtime checks a package for any accelerator."""
    chain: list = []
    for name in (wanted, *PROVIDER_FALLBACKS.get(wanted, ())):
        if name in available and name != "CPUExecutionProvider":
            own = options if name == wanted else {k: v for k, v in options.items() if k == "device_id"}
            chain.append((name, {k: str(v) for k, v in own.items()}))
    return [*chain, "CPUExecutionProvider"]


class OnnxPackage:
    """An exported package: ``encoder.onnx``, ``decoder_first.onnx``, ``decoder_step.onnx`` + JSON;
    with ``decoder_verify.onnx`` and a drafter (``package.json: drafter``), speculative decoding.

    ``speculative``: decode a batch of one speculatively where the package can (its readings are
    token for token greedy's); False: plain greedy always. Batches of more than one image decode
    image by image speculatively where the package's target says so (:attr:`speculative_batches`: a
    CPU's), else in plain greedy steps (rows would accept drafts of different lengths)."""

    def __init__(self, folder: str | Path, threads: int = 0, provider: str | None = None, speculative: bool = True,
                 provider_options: dict | None = None, flush_denormals: bool | None = None,
                 session_entries: dict[str, str] | None = None):
        import onnxruntime as ort

        self.folder = Path(folder)
        if not (self.folder / PACKAGE_META).is_file():
            raise PipelineError(f"not an exported package (no {PACKAGE_META}): {self.folder}")
        self.meta = load_json(self.folder / PACKAGE_META, schema.PACKAGE, f"package {self.folder}")
        if self.meta["format"] not in FORMATS:
            raise PipelineError(f"package {self.folder}: format {self.meta['format']!r} is not one this runtime reads "
                                f"({', '.join(FORMATS)}): export it again with this version, or read it with the "
                                f"version that wrote it")
        self.preprocess_spec = load_json(self.folder / PREPROCESS, schema.PREPROCESS, f"package {self.folder}")
        from pipeline.preprocessing import check_spec

        check_spec(self.preprocess_spec, f"{PREPROCESS} in {self.folder}")  # its kind's own fields, before any image
        self.tokenizer = package_tokenizer(self.folder / TOKENIZER, self.meta)
        wanted = provider or self.meta.get("provider", "CPUExecutionProvider")
        options = {**(self.meta.get("provider_options") or {}), **(provider_options or {})}
        providers = provider_chain(wanted, ort.get_available_providers(), options)
        self.provider = providers[0] if isinstance(providers[0], str) else providers[0][0]
        # the package's session config (packages from before it was recorded: this runtime's defaults);
        # flush_denormals overrides its denormal entry (the benchmark's plain row: what users ran before)
        # session_entries: entries over the package's own (a benchmark's comparison)
        config = {**session_config(), **(self.meta.get("session_config") or {}), **(session_entries or {})}
        if flush_denormals is not None:
            config[denormals.SESSION_ENTRY] = "1" if flush_denormals else "0"
        self.flush_denormals = config[denormals.SESSION_ENTRY] == "1"
        self._mode_warned = False
        self._session_args = (threads, config, providers)
        self.sessions = {}
        for graph in REQUIRED_GRAPHS:
            path = self.folder / self.meta["graphs"][graph]
            if not path.is_file():
                raise PipelineError(f"package {self.folder} is incomplete: {path.name} missing")
            self.use_graph(graph, path)
        self.io = self.meta["io"]
        self.bos, self.eos = int(self.meta["bos_id"]), int(self.meta["eos_id"])
        self.banned = [int(i) for i in self.meta["banned_token_ids"]]
        # greedy decoding's cap on layout-only runs (pipeline/decoding.py); packages from before it: none
        self.layout_run_cap = int(self.meta.get("layout_run_cap", 0))
        self.token_policy = None  # the encoder reads the patch tokens it keeps (pipeline/tokens/policy.py)
        if self.meta.get("token_policy") is not None:
            from pipeline.tokens.policy import TokenPolicy

            self.token_policy = TokenPolicy.from_dict(self.meta["token_policy"], f"{PACKAGE_META} in {self.folder}")
        self.tokens_kept: collections.Counter = collections.Counter()  # tokens an image's encoder read -> images
        self._guard: LayoutGuard | None = None
        self.num_layers = int(self.meta["num_layers"])
        self.max_length = int(self.meta["max_length"])  # the export's decode cap (tokens incl. BOS)
        # the decoder's position table; packages from before it was recorded: their export cap
        self.max_positions = int(self.meta.get("max_positions", self.max_length))
        self.drafter, self.draft_len = None, 0
        self._calls: VerifyCalls | None = None
        self.spec_stats = SpeculativeStats()
        if speculative and self.meta.get("drafter"):
            self.drafter, self.draft_len = self._load_drafter()

    def _load_drafter(self):
        """The package's drafter (``package.json: drafter``, a file in the package), and the verify graph."""
        if DECODER_VERIFY not in self.meta["graphs"]:
            raise PipelineError(f"package {self.folder}: package.json names a drafter but no decoder_verify graph")
        path = self.folder / str(self.meta["drafter"])
        if not path.is_file():
            raise PipelineError(f"package {self.folder} is incomplete: {path.name} missing")
        texts = [self.tokenizer.decode([i]) for i in range(self._vocab())]
        try:
            drafter, draft_len = drafting.load(
                path, texts, open_reader=lambda entry: StudentReader.from_entry(entry, self.drafter_graph))
        except ValueError as exc:
            raise PipelineError(str(exc)) from None
        width = self.verify_width
        if draft_len > width - 1:
            raise PipelineError(f"package {self.folder}: the drafter's draft_len {draft_len} does not fit the "
                                f"verify graph's width {width} (the last written token + {width - 1} drafts)")
        return drafter, draft_len

    def drafter_graph(self, name: str):
        """An ONNX Runtime session of a graph the drafter names (a file in the package), with the
        package's session options."""
        path = self.folder / Path(name).name
        if not path.is_file():
            raise PipelineError(f"package {self.folder} is incomplete: the drafter's {path.name} missing")
        return self._session("the drafter", path)

    @property
    def verify_width(self) -> int:
        """Tokens a ``decoder_verify`` call reads at most (``package.json: verify_width``; a graph of fixed
        width, from before the width was dynamic: that width)."""
        return self._verify_geometry()[0]

    def _verify_geometry(self) -> tuple[int, bool]:
        """``decoder_verify``'s width and whether the graph fixes it."""
        width = self._verify_session().get_inputs()[0].shape[-1]
        if isinstance(width, int):
            return width, True
        if not isinstance(self.meta.get("verify_width"), int) or self.meta["verify_width"] < 2:
            raise PipelineError(f"package {self.folder}: decoder_verify's width is dynamic and package.json "
                                f"has no verify_width (an integer >= 2): {self.meta.get('verify_width')!r}")
        return int(self.meta["verify_width"]), False

    def _verify_session(self):
        if DECODER_VERIFY not in self.sessions:
            if DECODER_VERIFY not in self.meta["graphs"]:
                raise PipelineError(f"package {self.folder} has no decoder_verify graph (exported before it existed)")
            self.use_graph(DECODER_VERIFY, self.folder / self.meta["graphs"][DECODER_VERIFY])
        return self.sessions[DECODER_VERIFY]

    def _vocab(self) -> int:
        """The decoder's vocabulary size, from the step graph's logits."""
        size = self.sessions[DECODER_STEP].get_outputs()[0].shape[-1]
        if not isinstance(size, int):
            raise PipelineError(f"package {self.folder}: decoder_step's logits have no fixed vocabulary size ({size!r})")
        return size

    @property
    def speculative(self) -> bool:
        return self.drafter is not None

    @property
    def speculative_batches(self) -> bool:
        """Whether a batch of several images decodes speculatively too, image by image after the batch's
        encoder call (``package.json: speculative_batches``, its target's): on a CPU a batched greedy step
        reads every row's cross-attention K/V and gains nothing from the batch. False: such a batch decodes
        in plain greedy steps, all rows at once (a GPU; packages from before the key)."""
        return self.speculative and bool(self.meta.get("speculative_batches", False))

    def use_graph(self, graph: str, path: str | Path) -> None:
        """Run ``graph`` from ``path`` (same inputs and outputs): how a quantized encoder variant is
        tried against the package's decoder without writing a package per variant."""
        self.sessions[graph] = self._session(graph, path)

    def _session(self, what: str, path: str | Path):
        """An ONNX Runtime session of ``path`` with the package's options; a graph it cannot load is one
        error line."""
        import onnxruntime as ort

        threads, config, providers = self._session_args
        # ONNX Runtime's S8-to-U8 rewrite that PRECISE_INT8 turns on fails on some QDQ graphs of its own
        # quantize_static (S8 activations; "Attempt to replace the existing tensor"): read those as it would
        # without the entry, and say so
        tries = [config] + ([{**config, PRECISE_INT8: "0"}] if config.get(PRECISE_INT8) == "1" else [])
        error = ""
        for k, entries in enumerate(tries):
            try:  # made in the package's mode: the session's pool threads start with this thread's
                with denormals.thread_mode(self.flush_denormals):
                    session = ort.InferenceSession(str(path), session_options(threads, entries), providers=providers)
            except Exception as exc:  # onnxruntime raises its own exception types
                error = error or str(exc).splitlines()[0]
                continue
            if k:
                log.warning("%s: ONNX Runtime cannot load %s with %s=1 (%s); reading it with its U8S8 kernels, which "
                            "saturate on CPUs without VNNI", what, Path(path).name, PRECISE_INT8, error)
            return session
        raise PipelineError(f"{what}: ONNX Runtime cannot load {Path(path).name}: {error}")

    # ---- steps --------------------------------------------------------------------------------
    def preprocess(self, image: Image.Image) -> np.ndarray:
        return preprocess_image(image, self.preprocess_spec)

    def encode(self, images: np.ndarray, keep: np.ndarray | None = None) -> np.ndarray:
        """Memory [B, N, D] of preprocessed images; with a token policy, of the kept patches only (``keep``
        [B, K]: computed here from the images when not given; refused in one line when it does not fit)."""
        images = images.astype(np.float32, copy=False)
        if self.token_policy is None:
            return self.sessions[ENCODER].run(["memory"], {"images": images})[0]
        keep = self.token_policy.keep_batch(images) if keep is None else np.asarray(keep, dtype=np.int64)
        self.token_policy.check(keep, images.shape[0])
        self.tokens_kept[int(keep.shape[1])] += images.shape[0]
        return self.sessions[ENCODER].run(["memory"], {"images": images, "keep": keep})[0]

    def first(self, input_ids: np.ndarray, memory: np.ndarray) -> tuple[np.ndarray, list, list]:
        outs = self.sessions[DECODER_FIRST].run(None, {"input_ids": input_ids.astype(np.int64), "memory": memory})
        n = 2 * self.num_layers
        return outs[0], outs[1:1 + n], outs[1 + n:]

    def step(self, input_ids: np.ndarray, past: list, cross: list) -> tuple[np.ndarray, list]:
        names = self.io[DECODER_STEP]["inputs"]
        feed = dict(zip(names, [input_ids.astype(np.int64), *past, *cross]))
        outs = self.sessions[DECODER_STEP].run(None, feed)
        return outs[0], outs[1:]

    def verify(self, input_ids: np.ndarray, past: list, cross: list) -> tuple[np.ndarray, list]:
        """Up to ``verify_width`` tokens after ``past`` (batch 1) in one call: logits [1, T, V] after
        each of the T, present grown by T or more (a padded call's extra K/V included, for the caller to
        cut: :class:`VerifyCalls`)."""
        return self._verify_calls()(input_ids, past, cross)

    @property
    def free_drafts(self) -> int:
        """Drafts a lone token's verify call checks at no cost (:attr:`VerifyCalls.free_drafts`)."""
        return self._verify_calls().free_drafts

    def _verify_calls(self) -> VerifyCalls:
        if self._calls is None:
            width, fixed = self._verify_geometry()
            self._calls = VerifyCalls(self._verify_run, self.step, width, self.max_positions, fixed)
        return self._calls

    def _verify_run(self, input_ids: np.ndarray, past: list, cross: list) -> tuple[np.ndarray, list]:
        names = self.io[DECODER_VERIFY]["inputs"]
        feed = dict(zip(names, [input_ids.astype(np.int64), *(np.ascontiguousarray(p) for p in past), *cross]))
        outs = self._verify_session().run(None, feed)
        return outs[0], outs[1:]

    # ---- greedy decoding ------------------------------------------------------------------------
    def generate(self, images: np.ndarray, max_length: int, batch_size: int = 16,
                 progress: Callable[[int], None] | None = None, speculative: bool | None = None) -> DecodeResult:
        """Greedy decoding as :meth:`ModelAdapter.generate` does it (cap includes BOS, finished
        rows leave the batch), with the KV cache: one decoder step per new token. A package with a
        drafter reads batches of one speculatively (the same tokens, fewer decoder calls), and batches of
        more image by image the same way where :attr:`speculative_batches` says so, unless
        ``speculative=False`` (plain greedy)."""
        spec = self.speculative if speculative is None else speculative and self.speculative
        return self._decode(images, max_length, batch_size, progress, "speculative" if spec else "greedy")

    def verify_greedy(self, images: np.ndarray, max_length: int,
                      progress: Callable[[int], None] | None = None) -> DecodeResult:
        """Plain greedy decoding image by image on ``decoder_verify`` (every token alone, padded to two
        rows): the readings speculative decoding writes token for token, whatever the drafter proposes
        (:class:`VerifyCalls`). A check, not a fast path: plain greedy on the step graph is faster and can
        differ from it at near-ties (the step attends from one query row, rounded by another kernel)."""
        return self._decode(images, max_length, 1, progress, "verify_greedy")

    def _decode(self, images: np.ndarray, max_length: int, batch_size: int,
                progress: Callable[[int], None] | None, how: str) -> DecodeResult:
        """The reading in the package's denormal mode on the calling thread, whichever it is (a session sets
        only the thread that created it: a serving worker or an actor may read on another)."""
        with denormals.thread_mode(self.flush_denormals) as done:
            if not done and not self._mode_warned:
                self._mode_warned = True
                log.warning(f"package {self.folder}: this thread flushes denormals and cannot be set back without "
                            f"torch; it reads with them flushed")
            return self._decode_batches(images, max_length, batch_size, progress, how)

    def _decode_batches(self, images: np.ndarray, max_length: int, batch_size: int,
                        progress: Callable[[int], None] | None, how: str) -> DecodeResult:
        all_ids: list[list[int]] = [[] for _ in range(images.shape[0])]
        calls: list[int] = [0] * images.shape[0]
        enc_s = dec_s = 0.0
        # with a token policy each image's kept indices once: they give its bucket (batches of one bucket,
        # as reading_batches cuts them) and the encoder's keep input
        keeps = None if self.token_policy is None else [self.token_policy.keep(im) for im in images]
        runs = reading_batches(images, batch_size) if keeps is None else grouped_batches([k.size for k in keeps], batch_size)
        for rows in runs:
            batch = images[rows]
            t0 = time.perf_counter()
            memory = self.encode(batch) if keeps is None else self.encode(batch, np.stack([keeps[r] for r in rows]))
            t1 = time.perf_counter()
            if how == "speculative" and (batch.shape[0] == 1 or self.speculative_batches):
                for k, row in enumerate(rows):  # each image on its own: rows accept different drafts
                    before = self.spec_stats.calls
                    all_ids[row] = self._speculative(memory[k:k + 1], max_length)
                    calls[row] = self.spec_stats.calls - before
            elif how == "verify_greedy":
                stats = SpeculativeStats()
                all_ids[rows[0]] = self._speculative(memory, max_length, drafted=False, stats=stats)
                calls[rows[0]] = stats.calls
            else:
                for row, ids in zip(rows, self.greedy_from_memory(memory, max_length)):
                    all_ids[row], calls[row] = ids, len(ids)
            dec_s += time.perf_counter() - t1
            enc_s += t1 - t0
            if progress is not None:
                progress(batch.shape[0])
            interrupts.check()  # a signal a native callback swallowed ends the reading here
        steps = [len(ids) for ids in all_ids]
        capped = [not ids or ids[-1] != self.eos for ids in all_ids]
        return DecodeResult(all_ids, [self.tokenizer.decode(i) for i in all_ids], enc_s, dec_s, steps, capped, calls)

    def layout_guard(self, vocab_size: int) -> LayoutGuard:
        """The package's cap on layout-only runs, for the decoder's ``vocab_size`` token ids."""
        if self._guard is None or len(self._guard.texts) != vocab_size:
            self._guard = LayoutGuard.for_vocabulary(lambda i: self.tokenizer.decode([i]), vocab_size, self.eos,
                                                     self.layout_run_cap)
        return self._guard

    def _speculative(self, memory: np.ndarray, max_length: int, drafted: bool = True,
                     stats: SpeculativeStats | None = None) -> list[int]:
        """One image's reading, speculatively (``pipeline/decoding.py``): greedy's tokens. ``drafted``
        False: nothing drafted, every token its own verify call (:meth:`verify_greedy`)."""
        guard = None
        if self.layout_run_cap:
            guard = self.layout_guard(self._vocab())
        propose = self.drafter.propose if drafted else (lambda ids, k, at_least: [])
        stats = self.spec_stats if stats is None else stats
        if drafted and hasattr(self.drafter, "begin"):  # a drafter that reads the image first (the student)
            stats.drafter_calls += self.drafter.begin(memory)
        return speculative_greedy(lambda ids: self.first(ids, memory), self.verify, propose,
                                  self.bos, self.eos, self.banned, max_length, self.draft_len if drafted else 0,
                                  guard, stats, self.free_drafts if drafted else 0)

    def greedy_from_memory(self, memory: np.ndarray, max_length: int) -> list[list[int]]:
        """Plain greedy decoding of a batch (:func:`pipeline.decoding.cached_greedy`) on this package's
        sessions: ``decoder_first`` after BOS, then ``decoder_step`` with the KV cache, from an encoder
        ``memory`` already computed (:meth:`encode`): a benchmark that reads one image's memory several ways
        encodes it once."""
        guard = self.layout_guard(self._vocab()) if self.layout_run_cap else None
        return cached_greedy(lambda ids: self.first(ids, memory), self.step, memory.shape[0], self.bos, self.eos,
                             self.banned, max_length, guard)

    def read_images(self, images: Sequence[Image.Image], max_length: int | None = None, batch_size: int = 16
                    ) -> DecodeResult:
        arr = np.stack([self.preprocess(im) for im in images])
        return self.generate(arr, int(max_length or self.max_length), batch_size)
