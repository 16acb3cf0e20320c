"""What every stage gets: the resolved root config, the artifacts root, and shared services
(loading a model by reference, the formula corpus, atomic stage outputs)."""
from __future__ import annotations

import contextlib
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

from pipeline.adapters.base import ModelAdapter, adapter_class, load_adapter
from pipeline.artifacts import StageOutput, read_manifest, sha256_dir, sha256_file, sha256_json, stage_output
from pipeline.data.corpus import SHIFT, Formula, build_corpus, build_shift_split, read_jsonl, write_jsonl
from pipeline.errors import ConfigError, PipelineError
from pipeline.names import FORMULAS_FILE, MANIFEST

log = logging.getLogger(__name__)

ORIGINAL = ("original", "package")
MODEL_SUBDIR = "model"  # a stage that produces a model writes it to <stage folder>/model/
SHIFT_FOLDER = "corpus-shift"  # the shift split's artifact folder
# config keys of the stages a sweep job gets its own folders for (the model chain); the others
# (evaluate, tokenizer, calibrate, the corpus) are shared by every job
JOB_SCOPED = ("prune", "distill", "quantize", "export", "benchmark")


@dataclass(frozen=True)
class ModelLimits:
    """What every reading of the model is bounded by (``model.*``): read once here, used by every stage."""
    max_length: int          # the decode cap: tokens incl. BOS
    batch_size: int          # images a reading batch holds
    threads: int             # intra-op threads; 0: the runtime's default
    flush_denormals: bool    # ONNX Runtime sessions (and torch) flush denormals to zero


@dataclass
class StageContext:
    cfg: DictConfig  # the whole resolved config (model, data, target, artifacts, seed, ...)

    @classmethod
    def compose(cls, artifacts: Path, overrides: list[str] | tuple[str, ...] = ()) -> "StageContext":
        """The context ``python -m pipeline`` would build for ``artifacts`` and ``overrides`` (no progress
        bars): how a script in benchmarks/ reads the artifacts and splits the stages use."""
        from hydra import compose, initialize_config_dir

        from pipeline import CONF_DIR
        from pipeline.config import register_configs

        register_configs()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(config_name="config", overrides=[f"artifacts.dir={artifacts}", "progress=false", *overrides])
        return cls(cfg)

    @property
    def artifacts_dir(self) -> Path:
        return Path(self.cfg.artifacts.dir)

    @property
    def force(self) -> bool:
        return bool(self.cfg.artifacts.force)

    @property
    def seed(self) -> int:
        return int(self.cfg.seed)

    @property
    def progress(self) -> bool:
        """Progress bars: ``progress=true|false`` when set, else only when stderr is a terminal."""
        return progress_enabled(self.cfg.get("progress"))

    def section(self, key: str) -> dict[str, Any]:
        return OmegaConf.to_container(self.cfg[key], resolve=True)  # type: ignore[return-value]

    @contextlib.contextmanager
    def output(self, name: str, config: dict[str, Any], inputs: dict[str, str]) -> Iterator[StageOutput]:
        with stage_output(self.artifacts_dir, name, config, inputs, force=self.force) as out:
            yield out

    @contextlib.contextmanager
    def cache_output(self, name: str, config: dict[str, Any], inputs: dict[str, str]) -> Iterator[StageOutput]:
        """Like :meth:`output`, under ``<artifacts>/cache/``: results a stage keeps for later runs and
        sweep jobs (head scores, the original's row of a table), not artifacts of their own."""
        root = self.artifacts_dir / "cache"
        root.mkdir(parents=True, exist_ok=True)
        with stage_output(root, name, config, inputs, force=self.force) as out:
            yield out

    # ---- models -----------------------------------------------------------------------------
    def model_folder(self, ref: str) -> Path | None:
        """``original`` -> None (the packaged weights); a stage name -> its model folder; else a path."""
        if ref in ORIGINAL:
            return None
        by_stage = self.artifacts_dir / ref / MODEL_SUBDIR
        if (by_stage / "config.json").is_file():
            return by_stage
        path = Path(ref)
        if (path / "config.json").is_file():
            return path
        if (path / MODEL_SUBDIR / "config.json").is_file():
            return path / MODEL_SUBDIR
        raise PipelineError(f"no model {ref!r}: not 'original', not a stage with a model under "
                            f"{self.artifacts_dir}, not a saved model folder")

    # ---- sweeps --------------------------------------------------------------------------------
    def job_overrides(self, stage: str) -> list[str] | None:
        """In a Hydra multirun job: the job's overrides of ``stage`` and of the model-chain stages
        before it (:data:`JOB_SCOPED`; ``*.name`` left out), swept keys first; None outside a multirun."""
        try:
            from hydra.core.hydra_config import HydraConfig
            from hydra.types import RunMode

            hc = HydraConfig.get()
        except (ValueError, ImportError):  # not under Hydra (tests, library use)
            return None
        if hc.mode != RunMode.MULTIRUN:
            return None
        scope = JOB_SCOPED[:JOB_SCOPED.index(stage) + 1]
        own = []
        for o in hc.overrides.task:
            key = o.split("=", 1)[0].lstrip("+~")
            if key.split(".")[0] in scope and not key.endswith(".name"):
                own.append(o.lstrip("+~"))
        swept = _swept_keys(Path(hc.sweep.dir)) if own else set()  # first, so a shortened tag still says what differs
        return sorted(own, key=lambda o: (o.split("=", 1)[0] not in swept, o))

    def job_tag(self, stage: str) -> str | None:
        """The multirun job's :meth:`job_overrides` of ``stage`` as a folder-name suffix, so the jobs of
        a sweep never overwrite each other and a later sweep with the same upstream overrides finds
        its jobs' folders; the job's number when it overrides none of those keys. None outside a
        multirun."""
        own = self.job_overrides(stage)
        if own is None:
            return None
        if not own:  # a sweep over other keys (seed=0,1): the job's number keeps the jobs apart
            from hydra.core.hydra_config import HydraConfig

            return str(HydraConfig.get().job.num)
        tag = re.sub(r"[^A-Za-z0-9_.,=+-]", "_", ",".join(own))
        if len(tag) > 100:  # long override lists: a readable prefix + a hash of all of them, never a clash
            tag = f"{tag[:90]}-{sha256_json(tag)[:8]}"
        return tag

    def artifact_name(self, default: str, explicit: str | None = None, stage: str | None = None) -> str:
        """A stage's folder name: ``explicit`` (its ``name`` key) when given, else ``default``, with
        the multirun job's tag for ``stage`` (default: ``default`` itself) appended inside a sweep."""
        if explicit:
            return explicit
        tag = self.job_tag(stage or default)
        return f"{default}-{tag}" if tag else default

    def stage_folder(self, name: str, stage: str | None = None) -> Path:
        """Where the artifact ``name`` of ``stage`` is for this run: the sweep job's own when it exists
        (a job of ``-m stage=export prune.num_heads=4,8`` finds ``prune-prune.num_heads=4``), else the
        shared one, unless the job overrides keys it was made with (:meth:`_no_fallback`)."""
        own = self.artifacts_dir / self.artifact_name(name, stage=stage or name)
        if (own / MANIFEST).is_file() or own.name == name:
            return own
        shared = self.artifacts_dir / name
        if (shared / MANIFEST).is_file():
            self._no_fallback(stage or name, own, shared)
        return shared

    def _no_fallback(self, stage: str, own: Path, shared: Path | None) -> None:
        """A sweep job that overrides keys of ``stage`` (or of the chain before it) and finds no
        artifact of its own must not take the shared one (made without those overrides), nor the
        original model: its folders would be named for settings they were not made with."""
        overrides = self.job_overrides(stage)
        if overrides:
            took = f"the shared {shared.name!r} was made without them" if shared is not None else \
                "without it the job would take an earlier model than its own"
            raise PipelineError(f"this sweep job overrides {', '.join(overrides)} but {own} does not exist ({took}); "
                                f"sweep the stages before it with the same overrides first, or sweep stage=all")

    def chain_upstream(self) -> tuple[str, ...]:
        """The stages whose model the chain hands on, in order: prune, then distill's BPE decoder
        when ``distill.in_chain`` (off until it meets its bar, docs/distill.md)."""
        distill = self.cfg.get("distill")
        return ("prune", "distill") if distill is not None and distill.get("in_chain") else ("prune",)

    def chain_model(self, ref: str, upstream: tuple[str, ...] = ("prune",)) -> str:
        """``auto``: the last stage of ``upstream`` whose model artifact exists (the chain hands its
        model over; a sweep job's own first), else ``original``; any other reference is returned as
        it is. A sweep job that overrides an upstream stage's keys needs that stage's own artifact."""
        if ref != "auto":
            return ref

        def has_model(name: str) -> bool:
            return (self.artifacts_dir / name / MODEL_SUBDIR / "config.json").is_file()

        for stage in reversed(upstream):
            own = self.artifact_name(stage)
            if has_model(own):
                return own
            if own != stage:
                self._no_fallback(stage, self.artifacts_dir / own, self.artifacts_dir / stage if has_model(stage) else None)
            if has_model(stage):
                return stage
        return "original"

    def chain_origin(self, ref: str) -> str:
        """The model the chain's model ``ref`` was made from, followed back through the manifests of
        the stages that made it (prune's ``model``, distill's ``model_ref``): what the baselines call
        the original. A model no stage under the artifacts made is its own origin."""
        seen = set()
        while ref not in ORIGINAL and ref not in seen:
            seen.add(ref)
            folder = self.artifacts_dir / ref
            if not (folder / MODEL_SUBDIR / "config.json").is_file():
                return ref  # a model folder of the user's
            config = read_manifest(folder).get("config", {})
            upstream = config.get("model_ref") or config.get("model")
            if not isinstance(upstream, str) or upstream == "auto":
                raise PipelineError(f"{folder}/manifest.json does not say which model {ref!r} was made from; "
                                    f"rerun its stage")
            ref = upstream
        return ref

    def model_source(self, ref: str = "original") -> str:
        """What the adapter's ``load`` takes for ``ref``: a model folder, or for the original
        ``model.path`` when set, else ``"package"`` (the adapter's own weights)."""
        folder = self.model_folder(ref)
        if folder is not None:
            return str(folder)
        return str(self.cfg.model.path) if self.cfg.model.path else "package"

    def check_model_source(self) -> None:
        """The original model's source checked by its adapter without loading the weights (a folder of
        the wrong kind, remote code, a pickle checkpoint: one line before any stage starts)."""
        if self.cfg.model.path:  # without it the original is the adapter's own (or a stage names a folder)
            adapter_class(self.cfg.model.adapter).check_source(str(self.cfg.model.path))

    def load_model(self, ref: str = "original") -> ModelAdapter:
        adapter = load_adapter(self.cfg.model.adapter, self.model_source(ref),
                               trust_checkpoint=bool(self.cfg.model.trust_checkpoint))
        check_max_length(self.limits.max_length, adapter.max_positions, f"model {ref!r}")
        adapter.layout_run_cap = int(self.cfg.model.layout_run_cap)
        return adapter

    @property
    def limits(self) -> ModelLimits:
        """The model config's limits (``model.max_length``, ``batch_size``, ``threads``, ``flush_denormals``)."""
        mcfg = self.cfg.model
        return ModelLimits(int(mcfg.max_length), int(mcfg.batch_size), int(mcfg.threads or 0),
                           bool(mcfg.flush_denormals))

    @property
    def device(self):
        """The ``torch.device`` of ``model.device`` (pipeline/device.py): where torch stages compute."""
        from pipeline.device import resolve

        return resolve(str(self.cfg.model.device))

    def training_precision(self, key: str, setting: str) -> str:
        """A training precision setting (``key``: ``auto`` | ``fp32`` | ``bf16``) as it runs on :attr:`device`:
        ``auto`` is bf16 where the device computes it natively, else fp32 (said in one line); the stage's
        artifact is keyed by what ran."""
        from pipeline.device import precision

        chosen = precision(str(getattr(setting, "value", setting)), self.device)
        if setting == "auto":
            log.info(f"[{key.split('.')[0]}] {key}=auto: {chosen} on {self.device}"
                     + ("" if chosen == "bf16" else " (no native bfloat16 here)"))
        return chosen

    def decoding_key(self) -> dict:
        """What of greedy decoding, besides ``max_length``, an artifact that decodes depends on: the
        layout-run cap when on ({} when off, so artifacts from before the cap keep their keys), and whether
        denormals are flushed (the same readings, other timings; a package records it)."""
        cap = int(self.cfg.model.layout_run_cap)
        return {**({"layout_run_cap": cap} if cap else {}), "flush_denormals": self.limits.flush_denormals}

    def model_tokenizer(self, ref: str = "original") -> tuple[Any, list[str]]:
        """The model's tokenizer and its output vocabulary (token strings in id order), from its
        adapter, without loading the weights."""
        cls = adapter_class(self.cfg.model.adapter)
        source = self.model_source(ref)
        return cls.text_tokenizer(source), cls.vocabulary(source)

    def model_hash(self, ref: str = "original") -> str:
        folder = self.model_folder(ref)
        if folder is None and self.cfg.model.path:
            path = Path(self.cfg.model.path)
            if not path.is_dir():
                raise PipelineError(f"model.path: no such folder {path}")
            return sha256_dir(path)
        if folder is None:
            from importlib import metadata
            return f"{self.cfg.model.adapter}:package:{metadata.version('latex-ocr-junia')}"
        return sha256_dir(folder)

    # ---- data -----------------------------------------------------------------------------------
    def corpus(self) -> list[Formula]:
        """The formula corpus (all splits), built once into ``<artifacts>/corpus`` and reused."""
        data = self.cfg.data
        config = {
            "packages": list(data.corpus_packages),
            "seed": int(data.seed),
            "shares": dict(data.shares),
            "min_chars": int(data.min_chars),
            "max_chars": int(data.max_chars),
            "max_width_px": int(data.max_width_px),
            "max_height_px": int(data.max_height_px),
        }
        inputs = _package_versions(config["packages"])
        with stage_output(self.artifacts_dir, "corpus", config, inputs, force=False) as out:
            if not out.reused:
                formulas = build_corpus(config["packages"], config["seed"], config["shares"],
                                        config["min_chars"], config["max_chars"], config["max_width_px"],
                                        config["max_height_px"], progress=self.progress)
                if not formulas:
                    raise PipelineError("the formula corpus is empty: no renderable formulas found")
                write_jsonl(out.path / FORMULAS_FILE, formulas)
                out.metrics.update({s: sum(f.split == s for f in formulas) for s in ("train", "calib", "eval")})
                out.metrics["total"] = len(formulas)
        return read_jsonl(out.path / FORMULAS_FILE)

    def shift_split(self) -> list[Formula]:
        """Formulas from ``data.shift_packages`` (none of which the corpus read) that are not in the
        corpus, built once into ``<artifacts>/corpus-shift`` and reused. For measuring only."""
        data = self.cfg.data
        packages = list(data.shift_packages)
        overlap = sorted(set(packages) & set(data.corpus_packages))
        if overlap:
            raise PipelineError(f"data.shift_packages {overlap} are corpus packages too: the shift split "
                                f"must come from sources training never saw")
        if not packages:
            raise PipelineError("data.shift_packages is empty: no source for the shift split")
        corpus = self.corpus()
        config = {"packages": packages, "directives": [".. math::", ".. math ::"], **{k: int(data[k]) for k in
                                           ("min_chars", "max_chars", "max_width_px", "max_height_px")}}
        inputs = {**_package_versions(packages), "corpus": self.split_hash("train")}
        with stage_output(self.artifacts_dir, SHIFT_FOLDER, config, inputs, force=False) as out:
            if not out.reused:
                formulas = build_shift_split(packages, {f.normalized for f in corpus}, config["min_chars"],
                                             config["max_chars"], config["max_width_px"], config["max_height_px"],
                                             progress=self.progress)
                write_jsonl(out.path / FORMULAS_FILE, formulas)
                out.metrics["total"] = len(formulas)
                out.metrics["by_package"] = {p: sum(f.source.split("/")[0] == p for f in formulas) for p in packages}
        return read_jsonl(out.path / FORMULAS_FILE)

    def split(self, name: str) -> list[Formula]:
        """A corpus split (train, calib, eval) or the shift split (``shift``)."""
        items = self.shift_split() if name == SHIFT else [f for f in self.corpus() if f.split == name]
        if not items:
            raise PipelineError(f"corpus split {name!r} is empty")
        return items

    def split_hash(self, name: str) -> str:
        """sha256 of the file a split is read from (an input hash for stages that read it)."""
        folder = SHIFT_FOLDER if name == SHIFT else "corpus"
        return self.upstream(folder)["outputs"][FORMULAS_FILE]

    def upstream(self, stage: str) -> dict[str, Any]:
        """Manifest of another stage's artifact (stages talk through artifacts, never imports)."""
        return read_manifest(self.artifacts_dir / stage)


def _swept_keys(sweep_dir: Path) -> set[str]:
    """The keys a multirun sweeps (``prune.num_heads=4,8``), from the ``multirun.yaml`` Hydra writes
    in the sweep folder before it launches the jobs; empty when it cannot be read."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        task = OmegaConf.load(sweep_dir / "multirun.yaml").hydra.overrides.task
        return {o.key_or_group for o in OverridesParser.create().parse_overrides(list(task)) if o.is_sweep_override()}
    except Exception:  # noqa: BLE001 - a missing or unreadable file only costs the ordering
        return set()


def progress_enabled(setting: bool | None) -> bool:
    """An explicit setting wins; unset (null), bars only when stderr is a terminal, so a log file
    of a run (``make run > log 2>&1``) does not fill with tqdm's redraws."""
    if setting is not None:
        return bool(setting)
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def check_max_length(max_length: int, limit: int | None, what: str, key: str = "model.max_length") -> None:
    """The decode cap against the model's position table, once the model is known."""
    if limit is not None and max_length > limit:
        raise ConfigError(f"{key}={max_length}: above the {limit} positions {what} holds; "
                          f"use {key}<={limit}")


def _package_versions(packages: list[str]) -> dict[str, str]:
    from importlib import metadata
    versions = {}
    for p in packages:
        try:
            versions[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            raise PipelineError(f"corpus package {p!r} is not installed") from None
    return versions


def file_hash(path: str | Path) -> str:
    p = Path(path)
    return sha256_dir(p) if p.is_dir() else sha256_file(p)
