"""Adapter for the ``latex-ocr-junia`` package: ViT encoder + transformer decoder, char tokenizer.

The package is a dependency from PyPI; its code and weights are never copied into this repo. At
load time every ``nn.MultiheadAttention`` is rewritten as :class:`ExplicitAttention` (numerically
the same function), which is what head removal, ModelOpt quantization and ONNX export need.
"""
from __future__ import annotations

import json
import pickle
import shutil
import zipfile
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from PIL import Image
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from pipeline import schema
from pipeline.adapters.attention import ExplicitAttention, reads_key_bias, remove_heads, replace_mha
from pipeline.adapters.base import ModelAdapter, SmoothPair, register_adapter
from pipeline.data.render import INK_THRESHOLD
from pipeline.errors import PipelineError, SchemaError
# the canvas is the package's preprocessing too (torch-free, beside its registered kind)
from pipeline.preprocessing import CANVAS_MARGIN, place_on_canvas, to_grey  # noqa: F401
from pipeline.schema import load_char_tokenizer, load_json
from pipeline.tokenization.bpe import BpeTokenizer, token_strings

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"


def package_assets() -> Path:
    try:
        import latex_ocr_junia
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise PipelineError("the default model needs the 'latex-ocr-junia' package (pip install latex-ocr-junia)") from exc
    return Path(latex_ocr_junia.__file__).resolve().parent / "assets"


def char_vocabulary(path: Path | None = None):
    """The model's char-level tokenizer (the package's own class and file; ``path``: a saved model's)."""
    from latex_ocr_junia.tokenizer import LatexTokenizer

    return LatexTokenizer.load(path if path is not None else package_assets() / TOKENIZER)


def safe_load_checkpoint(path: Path, trust: bool = False) -> Any:
    """``torch.load`` restricted to tensors and plain containers unless the user trusts the file."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"checkpoint not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # weights_only refuses a GLOBAL (a class or function to import); anything else is a broken file
        if "GLOBAL" not in str(exc):
            raise PipelineError(f"corrupt checkpoint {path}: not a readable torch checkpoint") from None
        if not trust:
            raise PipelineError(
                f"checkpoint {path} needs more than tensors to load (it would run pickled code); "
                "refusing. Set model.trust_checkpoint=true only if you trust where it came from") from None
        return torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as exc:
        raise PipelineError(f"corrupt checkpoint {path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


def _patch_grid(model_config: Any) -> tuple[int, int]:
    """Rows and columns of the patch grid the encoder's tokens are laid out on (row-major)."""
    p = model_config.patch_size
    return model_config.image_height // p, model_config.image_width // p


def check_model_config(meta: dict, path: Path) -> None:
    """What the schema cannot say alone: heads divide the width, one head count and MLP width per encoder layer."""
    mc = meta["model_config"]
    where = f"{path.name} in {path.parent}"
    if mc["d_model"] % mc["num_heads"]:
        raise SchemaError(f"{where}: field 'model_config.num_heads'={mc['num_heads']} does not divide "
                          f"'model_config.d_model'={mc['d_model']}")
    for key in ("encoder_heads", "encoder_mlp"):
        per_layer = meta.get(key)
        if per_layer is not None and len(per_layer) != mc["num_encoder_layers"]:
            raise SchemaError(f"{where}: field '{key}' has {len(per_layer)} entries for "
                              f"{mc['num_encoder_layers']} encoder layers")
    pools = meta.get("encoder_key_pools")
    if pools is not None:
        if len(pools) != mc["num_encoder_layers"]:
            raise SchemaError(f"{where}: field 'encoder_key_pools' has {len(pools)} entries for "
                              f"{mc['num_encoder_layers']} encoder layers")
        rows, cols = _patch_grid(SimpleNamespace(**mc))
        for i, (wr, wc) in enumerate(pools):
            if rows % wr or cols % wc:
                raise SchemaError(f"{where}: field 'encoder_key_pools[{i}]'={[wr, wc]} does not tile the "
                                  f"{rows}x{cols} patch grid")


@register_adapter("latex_ocr_junia")
class LatexOcrJuniaAdapter(ModelAdapter):
    def __init__(self, model: torch.nn.Module, model_config: Any, tokenizer: Any, tokenizer_path: Path):
        self.model = model.eval()
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.tokenizer_path = Path(tokenizer_path)

    # ---- loading and saving -------------------------------------------------------------
    @classmethod
    def _build(cls, model_config: Any, encoder_heads: Sequence[int] | None = None,
               key_pools: Sequence[Sequence[int]] | None = None,
               mlp_widths: Sequence[int] | None = None) -> torch.nn.Module:
        from latex_ocr_junia.model import build_model

        model = build_model(model_config)
        replace_mha(model)
        head_dim = model_config.d_model // model_config.num_heads
        for block, heads in zip(model.encoder_blocks, encoder_heads or []):
            if heads != block.attn.num_heads:
                block.attn = ExplicitAttention(model_config.d_model, heads, head_dim, dropout=model_config.dropout)
        for block, width in zip(model.encoder_blocks, mlp_widths or []):
            if width != model_config.mlp_dim:  # a narrowed MLP (stage prune: prune.mlp_ratio)
                block.mlp[0] = torch.nn.Linear(model_config.d_model, int(width))
                block.mlp[3] = torch.nn.Linear(int(width), model_config.d_model)
        grid = _patch_grid(model_config)
        for block, window in zip(model.encoder_blocks, key_pools or []):
            block.attn.pool_keys(grid, (int(window[0]), int(window[1])))
        return model.eval()

    @classmethod
    def load(cls, source: str, trust_checkpoint: bool = False) -> "LatexOcrJuniaAdapter":
        from latex_ocr_junia.tokenizer import LatexTokenizer
        from latex_ocr_junia.utils import load_model_config

        if source in ("package", "", None):
            assets = package_assets()
            model_config = load_model_config(assets / "model_config.json")
            checkpoint = safe_load_checkpoint(assets / "best.pt", trust_checkpoint)
            state = checkpoint.get("model_state_dict", checkpoint) if isinstance(checkpoint, dict) else None
            if not isinstance(state, dict):
                raise PipelineError(f"unsupported checkpoint layout in {assets / 'best.pt'}")
            reference = build_model_reference(model_config)
            try:
                reference.load_state_dict(state)
            except RuntimeError as exc:
                raise PipelineError(f"checkpoint does not fit the model: {str(exc).splitlines()[0]}") from None
            model = reference.eval()
            replace_mha(model)
            tokenizer_path = assets / "tokenizer.json"
        else:
            folder = Path(source)
            if not (folder / CONFIG).is_file():
                raise PipelineError(f"not a saved model folder (no {CONFIG}): {folder}")
            meta = load_json(folder / CONFIG, schema.MODEL_CONFIG, f"model folder {folder}")
            tokenizer_path = folder / TOKENIZER
            bpe = meta.get("tokenizer_kind") == "bpe"
            # before building: a missing or garbage tokenizer is named
            tokenizer = BpeTokenizer.from_file(tokenizer_path) if bpe else load_char_tokenizer(tokenizer_path)
            check_model_config(meta, folder / CONFIG)
            try:
                from latex_ocr_junia.model import ModelConfig
                model_config = ModelConfig(**meta["model_config"])
                model = cls._build(model_config, meta.get("encoder_heads"), meta.get("encoder_key_pools"),
                                   meta.get("encoder_mlp"))
                state = load_file(str(folder / WEIGHTS))
                model.load_state_dict(state)
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise PipelineError(f"corrupt model config {folder / CONFIG}: {exc}") from None
            except (SafetensorError, OSError, RuntimeError) as exc:
                raise PipelineError(f"corrupt model weights {folder / WEIGHTS}: {str(exc).splitlines()[0]}") from None
            policy = meta.get("token_policy")
            if bpe:
                if tokenizer.vocab_size != model_config.vocab_size:
                    raise SchemaError(f"{TOKENIZER} in {folder} has {tokenizer.vocab_size} entries; the model's "
                                      f"output layer has {model_config.vocab_size} (field 'model_config.vocab_size')")
                return cls._with_policy(cls(model, model_config, tokenizer, tokenizer_path), policy, folder)
            return cls._with_policy(cls(model, model_config, LatexTokenizer.load(tokenizer_path), tokenizer_path),
                                    policy, folder)
        tokenizer = LatexTokenizer.load(tokenizer_path)
        return cls(model, model_config, tokenizer, tokenizer_path)

    @staticmethod
    def _with_policy(adapter: "LatexOcrJuniaAdapter", policy: dict | None, folder: Path) -> "LatexOcrJuniaAdapter":
        if policy is not None:
            from pipeline.tokens.policy import TokenPolicy

            adapter.token_policy = TokenPolicy.from_dict(policy, f"{CONFIG} in {folder}: token_policy")
        return adapter

    @classmethod
    def text_tokenizer(cls, source: str):
        folder = None if source in ("package", "", None) else Path(source)
        if folder is not None and load_json(folder / CONFIG, schema.MODEL_CONFIG,
                                            f"model folder {folder}").get("tokenizer_kind") == "bpe":
            return BpeTokenizer.from_file(folder / TOKENIZER)
        return char_vocabulary(None if folder is None else folder / TOKENIZER)

    @classmethod
    def vocabulary(cls, source: str) -> list[str]:
        tok = cls.text_tokenizer(source)
        if isinstance(tok, BpeTokenizer):
            return token_strings(tok.tokenizer)
        return [t for t, _ in sorted(tok.token_to_id.items(), key=lambda kv: kv[1])]

    def source_files(self) -> list[Path]:
        # the shipped assets (checkpoint, config, tokenizer) or a saved model folder: both hold the tokenizer
        return sorted(p for p in self.tokenizer_path.parent.iterdir() if p.is_file())

    def save(self, folder: Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}
        save_file(state, str(folder / WEIGHTS), metadata={"family": self.family})
        pools, widths = self.encoder_key_pools(), self.encoder_mlp_widths()
        meta = {
            "family": self.family,
            "model_config": asdict(self.model_config),
            "encoder_heads": self.encoder_head_counts(),
            "head_dim": self.model_config.d_model // self.model_config.num_heads,
            # written only when some layer pools: a model without pooling saves what it always did
            **({"encoder_key_pools": pools} if any(w != [1, 1] for w in pools) else {}),
            # written only when some layer's MLP was narrowed (prune.mlp_ratio)
            **({"encoder_mlp": widths} if any(w != self.model_config.mlp_dim for w in widths) else {}),
            # a model recovered to read only some of its patch tokens (pipeline/tokens/policy.py)
            **({"token_policy": self.token_policy.to_dict()} if self.token_policy is not None else {}),
            "tokenizer": TOKENIZER,
            "tokenizer_kind": "bpe" if isinstance(self.tokenizer, BpeTokenizer) else "char",
        }
        (folder / CONFIG).write_text(json.dumps(meta, indent=2))
        shutil.copyfile(self.tokenizer_path, folder / TOKENIZER)

    # ---- input ------------------------------------------------------------------------------
    @property
    def input_shape(self) -> tuple[int, int, int]:
        return 1, self.model_config.image_height, self.model_config.image_width

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        canvas = place_on_canvas(to_grey(image), self.model_config.image_height, self.model_config.image_width)
        return torch.from_numpy(np.asarray(canvas, dtype=np.float32) / 255.0)[None]

    def preprocess_spec(self) -> dict:
        c, h, w = self.input_shape
        return {"kind": "latex_ocr_junia.canvas", "channels": c, "height": h, "width": w, "margin": CANVAS_MARGIN,
                "ink_threshold": INK_THRESHOLD, "scale": 255.0, "grey": True, "invert_dark_background": True,
                "note": "any image -> 8-bit grey (transparency on white) -> ink crop centred on a white "
                        "height x width canvas, shrunk never enlarged, margin px kept -> float32 / scale, [C, H, W]"}

    # ---- tokens -------------------------------------------------------------------------------
    @property
    def bos_id(self) -> int:
        return self.tokenizer.bos_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    @property
    def max_positions(self) -> int:
        return int(self.model_config.max_length)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def encode_text(self, latex: str) -> list[int]:
        return self.tokenizer.encode(latex, max_length=self.model_config.max_length)

    def decode_text(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids))

    # ---- compute ------------------------------------------------------------------------------
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        images = images.to(self.device)
        if self.token_policy is not None:
            return self.encode_kept(images, self.keep_indices(images))
        return self.model.encode(images)

    def encode_kept(self, images: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """The package's encoder on the kept patches: conv(patch) + position, gathered, then LayerNorm and the
        blocks (no class token: dropping a patch is a gather)."""
        pe = self.model.patch_embed
        x = pe.proj(images.to(self.device)).flatten(2).transpose(1, 2) + pe.pos_emb
        keep = keep.to(x.device)
        x = torch.gather(x, 1, keep[:, :, None].expand(-1, -1, x.shape[-1]))
        x = pe.dropout(pe.norm(x))
        return self.model.encoder_norm(self.encoder_layers(x, self.model.encoder_blocks, keep=keep))

    def reads_proportional(self) -> bool:
        return reads_key_bias(self.model.encoder_blocks)

    def token_grid(self) -> tuple[int, int, int] | None:
        if any(w != [1, 1] for w in self.encoder_key_pools()):  # pooled keys need the whole grid
            return None
        return (*_patch_grid(self.model_config), int(self.model_config.patch_size))

    def token_policy_refusal(self) -> str:
        return ("a token policy needs every encoder layer's keys unpooled (a pooled layer averages windows of the "
                "whole patch grid): prune.key_pool_layers=[] with prune.tokens")

    def decode_logits(self, tokens: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.model.decode(tokens.to(self.device), memory.to(self.device))

    def cached_decoder(self):
        from pipeline.adapters.kv_cache import CachedDecoder

        return CachedDecoder(self.model).eval()

    def with_bpe(self, tokenizer_path: Path) -> "LatexOcrJuniaAdapter":
        from pipeline.adapters.junia_student import init_student, piece_map

        bpe = BpeTokenizer.from_file(tokenizer_path)
        try:
            pieces = piece_map(bpe.tokenizer, self.tokenizer)
        except ValueError as exc:
            raise PipelineError(f"{tokenizer_path}: {exc}") from None
        student, config = init_student(self.model, self.model_config, pieces)
        out = type(self)(student, config, bpe, tokenizer_path)
        out.layout_run_cap = self.layout_run_cap  # decodes as the char model it was made from
        out.token_policy = self.token_policy      # and reads the same tokens
        return out

    def decoder_parameters(self) -> list[torch.nn.Parameter]:
        return [p for n, p in self.model.named_parameters() if not n.startswith(("patch_embed", "encoder"))]

    def vocabulary_parameters(self) -> list[torch.nn.Parameter]:
        return [self.model.decoder_embed.token_emb.weight, *self.model.lm_head.parameters()]

    def cross_attention_parameters(self) -> list[torch.nn.Parameter]:
        return [p for blk in self.model.decoder_blocks for p in (*blk.cross_norm.parameters(),
                                                                  *blk.cross_attn.parameters())]

    # ---- structure ------------------------------------------------------------------------------
    def encoder_head_counts(self) -> list[int]:
        return [int(block.attn.num_heads) for block in self.model.encoder_blocks]

    def encoder_key_pools(self) -> list[list[int]]:
        return [list(block.attn.key_pool[2:]) if block.attn.key_pool else [1, 1] for block in self.model.encoder_blocks]

    def pool_encoder_keys(self, windows: dict[int, Sequence[int]]) -> None:
        grid = _patch_grid(self.model_config)
        for layer, window in windows.items():
            self.encoder_attention(int(layer)).pool_keys(grid, (int(window[0]), int(window[1])))

    def encoder_attention(self, layer: int) -> ExplicitAttention:
        return self.model.encoder_blocks[layer].attn

    def encoder_mlp(self, layer: int) -> tuple[torch.nn.Linear, torch.nn.Linear]:
        mlp = self.model.encoder_blocks[layer].mlp  # Linear, GELU, Dropout, Linear, Dropout
        return mlp[0], mlp[3]

    def remove_encoder_heads(self, heads: dict[int, Sequence[int]]) -> None:
        for layer, remove in heads.items():
            if remove:
                remove_heads(self.encoder_attention(int(layer)), remove)

    def smoothing_pairs(self) -> list:
        """Pre-LN blocks: norm1 feeds q/k/v, norm2 the first MLP projection, v_proj's output rows the
        output projection (the second MLP projection reads GELU's output: nothing linear to fold into)."""
        pairs = []
        for i, block in enumerate(self.model.encoder_blocks):
            a, p = block.attn, f"encoder_blocks.{i}"
            pairs += [SmoothPair(f"{p}.attn.qkv_proj", block.norm1, (a.q_proj, a.k_proj, a.v_proj)),
                      SmoothPair(f"{p}.mlp.mlp.0", block.norm2, (block.mlp[0],)),
                      SmoothPair(f"{p}.attn.out_proj", a.v_proj, (a.out_proj,))]
        return pairs


def build_model_reference(model_config: Any) -> torch.nn.Module:
    """The package's own model, unmodified (``nn.MultiheadAttention`` inside)."""
    from latex_ocr_junia.model import build_model

    return build_model(model_config).eval()
