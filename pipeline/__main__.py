"""``python -m pipeline stage=<name> [overrides]``: run one stage, or ``stage=all``.

Config mistakes (an unknown key, a wrong type, an unknown stage or group option) and bad input end
with one line on stderr and exit code 2; no artifact is written.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, NoReturn

import pipeline
from pipeline import denormals, interrupts
from pipeline.errors import Interrupted, PipelineError

if TYPE_CHECKING:
    from omegaconf import DictConfig

CONF_DIR = str(pipeline.CONF_DIR)  # the checkout's conf/, or the installed package's
log = logging.getLogger("pipeline")


def fail(message: str, interrupted: bool = False) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    if interrupted:
        # the run is over and its temporary output removed; leave now, so a KeyboardInterrupt still
        # pending in library teardown cannot turn exit code 2 into death by SIGINT (seen under load)
        sys.stdout.flush()
        logging.shutdown()
        os._exit(2)
    sys.exit(2)


def run_stages(cfg: DictConfig, ctx=None) -> dict:
    """Run ``cfg.stage`` (every stage of ``stage=all`` in order) with ``ctx`` (a fresh
    :class:`StageContext` of ``cfg`` when None). Under ``stage=all`` a stage's error line names the
    stage, so a failure an hour in says where it happened."""
    from omegaconf import OmegaConf

    from pipeline.context import StageContext
    from pipeline.stages import ORDER, STAGES

    if cfg.stage not in STAGES and cfg.stage != "all":
        raise PipelineError(f"unknown stage {cfg.stage!r}; known: {', '.join(['all', *STAGES])}")
    check_config(cfg)
    # before any torch op: torch's worker threads start with this thread's mode (pipeline/denormals.py)
    denormals.set_thread(bool(cfg.model.flush_denormals))
    if cfg.model.threads:
        import torch
        torch.set_num_threads(int(cfg.model.threads))
    names = list(ORDER) if cfg.stage == "all" else [cfg.stage]
    stage_cfgs = {}
    for name in names:  # every stage's keys before the first one runs
        spec = STAGES[name]
        stage_cfgs[name] = OmegaConf.to_object(cfg[spec.config_key])
        if cfg.stage == "all" and not getattr(stage_cfgs[name], "in_chain", True):
            continue
        try:
            spec.validate(stage_cfgs[name])
        except PipelineError as exc:
            if cfg.stage != "all":
                raise
            raise type(exc)(f"stage=all, stage {name}: {exc}") from None
    ctx = ctx if ctx is not None else StageContext(cfg)
    ctx.check_model_source()  # a model folder the adapter cannot read fails here, before any stage's work
    results = {}
    for name in names:
        spec = STAGES[name]
        stage_cfg = stage_cfgs[name]
        if cfg.stage == "all" and not getattr(stage_cfg, "in_chain", True):
            log.info(f"[{name}] off in stage=all ({spec.config_key}.in_chain=false): skipped")
            continue
        log.info(f"[{name}] {spec.doc}")
        try:
            results[name] = spec.run(stage_cfg, ctx)
        except PipelineError as exc:
            if cfg.stage != "all" or isinstance(exc, Interrupted):
                raise
            raise type(exc)(f"stage=all, stage {name}: {exc}") from None
    return results


def check_config(cfg: DictConfig) -> None:
    """Checks that need more than one field's dataclass (``__post_init__`` covers the numbers):
    artifact names are single folder names, the artifacts root can be a folder, the stage reads
    the ``data`` group it was given."""
    from omegaconf import OmegaConf

    from pipeline.files import check_name, check_output_dir
    from pipeline.stages import DATA_STAGES, STAGES, check_data_group

    OmegaConf.to_object(cfg.model)  # ModelConfig.__post_init__: also on multirun jobs
    from pipeline import device

    device.check(str(cfg.model.device))  # model.device=cuda without CUDA: one line, before any work
    for spec in STAGES.values():
        section = cfg.get(spec.config_key) if spec.config_key else None
        if section is not None and "name" in section:
            check_name(section.name, f"{spec.config_key}.name")
    check_output_dir(cfg.artifacts.dir, "artifacts.dir")
    check_data_group(str(cfg.stage), str(cfg.data.kind))
    check_model_refs(cfg)
    if cfg.stage == "all" or cfg.stage in DATA_STAGES:  # the stages that open the data group's source
        from calibration.sets import check_source

        check_source(cfg.data)
    if cfg.stage in ("export", "all"):  # target.* overrides reach their target and hold, or fail here
        from pipeline.export.targets import KNOWN, resolve_target, target_configs

        names = [str(t) for t in cfg.export.targets if t in KNOWN]  # unknown ones: export's check
        for tcfg in (target_configs(names, cfg.target).values() if cfg.export.targets else [cfg.target]):
            resolve_target(tcfg)


def check_model_refs(cfg: DictConfig) -> None:
    """The ``model`` key of each stage the run starts names the original, ``auto``, a stage with a model
    (by its stage or artifact name: an earlier stage of the chain makes it), an artifact under the root, or
    a folder: a typo fails here, not when its stage starts (under stage=all, after prune's minutes). The
    folder's contents are the stage's to check (:meth:`StageContext.model_folder`)."""
    from pathlib import Path

    from pipeline.context import ORIGINAL
    from pipeline.errors import ConfigError
    from pipeline.stages import ORDER, STAGES

    runs = [STAGES[n] for n in (ORDER if cfg.stage == "all" else [cfg.stage]) if n in STAGES]
    named = {str(cfg[s.config_key].name) for s in STAGES.values()
             if cfg.get(s.config_key) is not None and cfg[s.config_key].get("name")}
    known = {*ORIGINAL, "auto", *STAGES, *named}
    root = Path(str(cfg.artifacts.dir))
    for spec in runs:
        section = cfg.get(spec.config_key)
        if section is None or section.get("model") is None:
            continue
        if cfg.stage == "all" and not section.get("in_chain", True):
            continue
        ref = str(section.model)
        if ref not in known and not (root / ref).exists() and not Path(ref).exists():
            raise ConfigError(f"{spec.config_key}.model={ref!r}: not original or auto, not a stage or an artifact "
                              f"under {root}, not a folder")


def _task(cfg: DictConfig) -> None:
    """The one place an expected failure becomes ``error: <message>`` and exit code 2."""
    interrupts.install()  # a kill (SIGTERM: a scheduler, a timeout) unwinds like Ctrl-C
    try:
        run_stages(cfg)
        interrupts.check()  # a signal a native callback swallowed: the run still ends as interrupted
    except PipelineError as exc:
        interrupts.finished()
        fail(str(exc))
    except KeyboardInterrupt:
        interrupts.finished()
        fail(interrupts.message(), interrupted=True)
    except Exception:
        # a native call (pybind11: matplotlib's savefig, ...) turned the signal's KeyboardInterrupt
        # into an error of its own: the run was still interrupted, and says so in one line
        if not interrupts.received():
            raise
        interrupts.finished()
        fail(interrupts.message(), interrupted=True)
    interrupts.finished()  # published: a signal from now on has nothing left to stop


def _first_line(exc: BaseException) -> str:
    """Hydra/OmegaConf messages are multi-line; keep the lines that name the problem."""
    skip = ("full_key", "object_type", "reference_type", "To append", "Config search path",
            "Set the environment", "provider=")
    parts = []
    for e in (exc, exc.__cause__):
        if e is None:
            continue
        text = str(e)
        if "Available options in" in text:  # an unknown group option: list the known ones inline
            head, _, opts = text.partition("Available options in")
            options = [o.strip() for o in opts.split("Config search path")[0].split("\n")[1:] if o.startswith("\t")]
            text = head.strip() + f" (known: {', '.join(options)})"
        parts += [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith(skip)]
    return ": ".join(dict.fromkeys(parts)) if parts else type(exc).__name__


def _prevalidate(overrides: list[str]) -> None:
    """Compose the config once before Hydra runs, so a mistake is one line and exit code 2."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    plain = [o for o in overrides if not o.startswith(("hydra.", "hydra/", "+hydra", "~hydra"))]
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = compose(config_name="config", overrides=plain)
            OmegaConf.to_object(cfg)  # type-checks every structured node
            check_config(cfg)
    except PipelineError as exc:  # a dataclass's __post_init__ (ModelConfig ...): already one line
        fail(f"config: {exc}")
    except Exception as exc:  # hydra/omegaconf raise many types; all are config errors here
        if interrupts.received():  # a signal that landed inside Hydra's own code, not a config error
            fail(interrupts.message(), interrupted=True)
        if isinstance(exc.__cause__, PipelineError):
            fail(f"config: {exc.__cause__}")
        fail(f"config: {_first_line(exc)}")
    finally:
        GlobalHydra.instance().clear()
    from pipeline.stages import STAGES
    if cfg.stage != "all" and cfg.stage not in STAGES:
        fail(f"config: unknown stage {cfg.stage!r}; known: all, {', '.join(STAGES)}")


def main() -> None:
    # first, before the heavy imports: a Ctrl-C or SIGTERM during start-up is one line too
    interrupts.install()
    try:
        _main()
    except KeyboardInterrupt:
        interrupts.finished()
        fail(interrupts.message(), interrupted=True)
    except Exception:
        # a signal inside a native module's import turns the handler's KeyboardInterrupt into that
        # module's own error (onnxruntime: "ImportError: initialization failed"): still an interrupt
        if interrupts.received():
            interrupts.finished()
            fail(interrupts.message(), interrupted=True)
        raise
    finally:
        interrupts.finished()


def _main() -> None:
    import hydra

    from pipeline.config import register_configs

    register_configs()
    args = sys.argv[1:]
    multirun = any(a in ("-m", "--multirun") for a in args)
    flags = [a for a in args if a.startswith("-")]
    if not multirun and not flags:
        _prevalidate(args)
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    try:
        # a signal inside Hydra's own start-up (composing the config again) would become OmegaConf's error
        # and Hydra would print its traceback: until the run or the sweep starts (the callback
        # pipeline.hydra_hooks.StartUpOver) a signal is only recorded, then raised; --cfg and --help start neither
        with interrupts.recorded():
            hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")(_task)()
        interrupts.check()
    except SystemExit as exc:
        # Hydra turns an exception in its own start-up (composing the config) into exit code 1; when
        # a signal caused it, the run ends like any interrupted run
        if exc.code not in (0, None, 2) and interrupts.received():
            fail(interrupts.message(), interrupted=True)
        raise


if __name__ == "__main__":
    main()
