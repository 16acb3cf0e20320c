"""Schemas of the JSON files in package and model folders, checked on load so a wrong field is named.

A schema is a dict ``field -> Spec``; :func:`load_json` reads a file, parses it and checks it, and
raises :class:`pipeline.errors.SchemaError` naming the file and the first wrong field
(``package.json in pkg/: field 'bos_id' must be an integer >= 0, got 'one'``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pipeline.errors import SchemaError
from pipeline.names import DECODER_STEP, REQUIRED_GRAPHS


@dataclass(frozen=True)
class Spec:
    kind: str                           # int | number | str | bool | list | dict | file
    min: Optional[float] = None
    max: Optional[float] = None
    optional: bool = False
    items: Optional["Spec"] = None      # list items / dict values
    fields: Optional[dict] = None       # dict: named fields
    length: Optional[int] = None        # list: exact length

    def describe(self) -> str:
        what = {"int": "an integer", "number": "a number", "str": "a string", "bool": "true or false",
                "list": "a list", "dict": "an object", "file": "a file name in the folder"}[self.kind]
        if self.length is not None:
            what += f" of {self.length}"
        if self.items is not None and self.kind == "list":
            what += f" of {self.items.describe().removeprefix('an ').removeprefix('a ')}s"
        if self.min is not None and self.max is not None:
            return f"{what} in [{self.min:g}, {self.max:g}]"
        if self.min is not None:
            return f"{what} >= {self.min:g}"
        return what


def INT(min: float | None = None, **kw) -> Spec:  # noqa: N802  (reads like a type in a schema)
    return Spec("int", min=min, **kw)


def _type_ok(value: Any, spec: Spec) -> bool:
    if spec.kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if spec.kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if spec.kind in ("str", "file"):
        return isinstance(value, str)
    return isinstance(value, {"bool": bool, "list": list, "dict": dict}[spec.kind])


def check(value: Any, spec: Spec, path: str) -> Optional[str]:
    """The first problem with ``value`` at ``path``, or None."""
    if not _type_ok(value, spec):
        return f"field {path!r} must be {spec.describe()}, got {json.dumps(value)[:60]}"
    if spec.kind in ("int", "number") and ((spec.min is not None and value < spec.min)
                                           or (spec.max is not None and value > spec.max)):
        return f"field {path!r} must be {spec.describe()}, got {value}"
    if spec.kind == "file" and (not value or "/" in value or "\\" in value or value in (".", "..")):
        return f"field {path!r} must be {spec.describe()}, got {value!r}"
    if spec.kind == "list":
        if spec.length is not None and len(value) != spec.length:
            return f"field {path!r} must be {spec.describe()}, got {len(value)} items"
        for i, item in enumerate(value):
            if spec.items is not None and (err := check(item, spec.items, f"{path}[{i}]")):
                return err
    if spec.kind == "dict":
        if spec.fields is not None:
            return check_fields(value, spec.fields, path + ".")
        for k, item in value.items():
            if spec.items is not None and (err := check(item, spec.items, f"{path}[{k!r}]")):
                return err
    return None


def check_fields(obj: dict, fields: dict[str, Spec], prefix: str = "") -> Optional[str]:
    for name, spec in fields.items():
        if name not in obj:
            if not spec.optional:
                return f"field {prefix + name!r} is missing"
            continue
        if (err := check(obj[name], spec, prefix + name)) is not None:
            return err
    return None


def load_json(path: Path, fields: dict[str, Spec], what: str = "") -> dict:
    """Read, parse and check one JSON object file; every failure is one :class:`SchemaError`."""
    path = Path(path)
    where = f"{path.name} in {path.parent}"
    if not path.is_file():
        raise SchemaError(f"{what or path.parent}: {path.name} is missing from {path.parent}")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise SchemaError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise SchemaError(f"{where}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if not isinstance(data, dict):
        raise SchemaError(f"{where}: must be a JSON object, got {type(data).__name__}")
    if (err := check_fields(data, fields)) is not None:
        raise SchemaError(f"{where}: {err}")
    return data


# ---- the files ----------------------------------------------------------------------------------
GRAPHS = REQUIRED_GRAPHS  # every package holds these (pipeline.names)

PACKAGE = {
    "format": Spec("str"),
    "target": Spec("str"),
    "provider": Spec("str"),
    "provider_options": Spec("dict", optional=True),
    "graphs": Spec("dict", fields={g: Spec("file") for g in GRAPHS}),
    "io": Spec("dict", fields={DECODER_STEP: Spec("dict", fields={"inputs": Spec("list", items=Spec("str"))})}),
    "bos_id": INT(0), "eos_id": INT(0), "pad_id": INT(0, optional=True),
    "banned_token_ids": Spec("list", items=INT(0)),
    "max_length": INT(2),
    "max_positions": INT(2, optional=True),
    "layout_run_cap": INT(0, optional=True),
    "num_layers": INT(1), "num_heads": INT(1), "head_dim": INT(1), "hidden_size": INT(1),
    "input_shape": Spec("list", items=INT(1), length=3),
    "tokenizer": Spec("dict", optional=True, fields={"kind": Spec("str", optional=True)}),
    # with a drafter: a batch of several images decodes speculatively too, image by image (its target's
    # speculative_batches); absent (packages from before it): such a batch decodes in plain greedy steps
    "speculative_batches": Spec("bool", optional=True),
    # ONNX Runtime session config entries the package is read with (denormals flushed, pools not spinning;
    # pipeline/export/runtime.py: session_config); absent (packages from before it): the runtime's defaults
    "session_config": Spec("dict", optional=True, items=Spec("str")),
    # the encoder reads only the patch tokens this policy keeps (pipeline/tokens/policy.py); absent: all
    "token_policy": Spec("dict", optional=True),
}

# the fields every kind has; each kind's own fields are checked by pipeline/preprocessing.py's registry
PREPROCESS = {"kind": Spec("str"), "height": INT(1), "width": INT(1)}

CHAR_TOKENIZER = {
    "token_to_id": Spec("dict", items=INT(0)),
    "specials": Spec("dict", fields={k: Spec("str") for k in ("pad", "bos", "eos", "unk")}),
}

MODEL_CONFIG = {
    "model_config": Spec("dict", fields={
        **{k: INT(1) for k in ("image_height", "image_width", "patch_size", "d_model", "num_heads",
                               "num_encoder_layers", "num_decoder_layers", "mlp_dim", "max_length", "vocab_size")},
        "dropout": Spec("number", min=0, max=1),
        "pad_token_id": INT(0),
    }),
    "encoder_heads": Spec("list", items=INT(1), optional=True),
    "encoder_key_pools": Spec("list", items=Spec("list", items=INT(1), length=2), optional=True),
    "encoder_mlp": Spec("list", items=INT(1), optional=True),
    "tokenizer": Spec("file", optional=True),
}


def load_char_tokenizer(path: Path) -> dict:
    """``tokenizer.json`` of the char tokenizer: the schema, and every special a known token."""
    data = load_json(path, CHAR_TOKENIZER)
    missing = [f"{k}={v!r}" for k, v in data["specials"].items() if v not in data["token_to_id"]]
    if missing:
        raise SchemaError(f"{path.name} in {path.parent}: field 'specials' names tokens not in "
                          f"'token_to_id': {', '.join(missing)}")
    return data
