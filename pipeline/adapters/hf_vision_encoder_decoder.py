"""Adapter for Hugging Face ``VisionEncoderDecoderModel``s read from a local folder (TrOCR-style).

Supported: a ViT, DeiT or I-JEPA encoder (HF-style attention: separate q/k/v/o ``Linear``s, so heads are
removed by slicing, :mod:`pipeline.adapters.hf_vit`) and a TrOCR (post-LN) or mBART (pre-LN, as in
Donut and Nougat) decoder. The folder is ``save_pretrained``'s layout: ``config.json``,
``model.safetensors``, ``tokenizer.json`` (any HF ``tokenizers`` JSON) and
``preprocessor_config.json`` (the image processor, read as data: pipeline/preprocessing.py).
Weights load from safetensors only; code named by the folder (``auto_map``) is never run.

The KV-cached decoder (:class:`HfCachedDecoder`) recomputes the HF decoder's function from its
modules' weights with the cache as plain tensors, so export traces the same graphs it traces for the
default model. A model this adapter pruned is saved as its HF config, its weights (internal names)
and ``formula_compress.json`` (the heads each encoder layer kept).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from pipeline.adapters.attention import num_heads
from pipeline.adapters.base import ModelAdapter, register_adapter
from pipeline.adapters.hf_vit import remove_hf_heads
from pipeline.adapters.kv_cache import attend, merge_heads, split_heads
from pipeline.errors import PipelineError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
PREPROCESSOR = "preprocessor_config.json"
OWN = "formula_compress.json"  # what this pipeline changed (heads kept per encoder layer)
ENCODERS = ("vit", "deit", "ijepa")  # ViT-style layers (I-JEPA: ViT without the CLS token)
DECODERS = {"trocr": "post", "mbart": "pre", "gpt2": "gpt2"}  # each family's layout (where its LayerNorms are)
SUPPORTED = f"supported: a vision-encoder-decoder with a {', '.join(ENCODERS[:-1])} or {ENCODERS[-1]} encoder and a " \
            f"{', '.join(list(DECODERS)[:-1])} or {list(DECODERS)[-1]} decoder (with cross-attention), " \
            "save_pretrained's layout with model.safetensors"


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG
    if not path.is_file():
        raise PipelineError(f"not a Hugging Face model folder (no {CONFIG}): {folder}")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PipelineError(f"{path}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise PipelineError(f"{path}: not a model config")
    return config


def check_folder(folder: Path) -> dict:
    """The folder's config when this adapter supports the model; else one line saying what is."""
    folder = Path(folder)
    if not folder.is_dir():
        raise PipelineError(f"model.path: no such folder {folder}")
    config = _read_config(folder)
    for part in (config, config.get("encoder") or {}, config.get("decoder") or {}):
        if part.get("auto_map"):
            raise PipelineError(f"{folder}: the model needs its own code (auto_map); remote code is never run. "
                                f"{SUPPORTED}")
    kind = config.get("model_type")
    enc = (config.get("encoder") or {}).get("model_type")
    dec = (config.get("decoder") or {}).get("model_type")
    if kind != "vision-encoder-decoder" or enc not in ENCODERS or dec not in DECODERS:
        raise PipelineError(f"{folder}: unsupported model ({kind}: {enc} encoder, {dec} decoder); {SUPPORTED}")
    if dec == "gpt2" and not config["decoder"].get("add_cross_attention"):
        raise PipelineError(f"{folder}: its gpt2 decoder has no cross-attention (add_cross_attention); {SUPPORTED}")
    if not (folder / WEIGHTS).is_file():
        pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        why = f"only a pickle checkpoint ({pickled[0]}), which could run code when read" if pickled else "no weights"
        raise PipelineError(f"{folder}: {why}; {SUPPORTED}")
    for name in (TOKENIZER, PREPROCESSOR):
        if not (folder / name).is_file():
            raise PipelineError(f"{folder}: no {name}; {SUPPORTED}")
    return config


def special_ids(config: dict) -> tuple[int, int, int]:
    """(decoder start, EOS, pad) ids of a vision-encoder-decoder config."""
    dec = config.get("decoder") or {}

    def first(*keys: str) -> int:
        for source in (config, dec):
            for k in keys:
                if source.get(k) is not None:
                    return int(source[k])
        raise PipelineError(f"the model config names no {keys[0]}")

    return first("decoder_start_token_id", "bos_token_id"), first("eos_token_id"), first("pad_token_id")


class HfCachedDecoder(nn.Module):
    """A TrOCR or mBART decoder (``transformers`` modules) with its KV cache as plain tensors
    (:class:`pipeline.adapters.base.CachedDecoder`)."""

    def __init__(self, causal_lm: nn.Module, norm: str):
        super().__init__()
        self.decoder = causal_lm.model.decoder
        self.head = causal_lm.get_output_embeddings()
        self.norm = norm  # "pre" (mBART) or "post" (TrOCR)
        self.layers = self.decoder.layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @staticmethod
    def _heads(x: torch.Tensor, attn: nn.Module) -> torch.Tensor:
        # the head count spelled out: ORT's attention fusion reads it off the reshape
        return split_heads(x, attn.num_heads, attn.head_dim)

    def cross_kv(self, memory: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for layer in self.layers:
            a = layer.encoder_attn
            out += [self._heads(a.k_proj(memory), a), self._heads(a.v_proj(memory), a)]
        return out

    def _attend(self, attn: nn.Module, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                offset: int | torch.Tensor | None) -> torch.Tensor:
        ctx = attend(self._heads(attn.q_proj(x), attn), k, v, offset, attn.head_dim)
        return attn.out_proj(merge_heads(ctx, x, attn.num_heads, attn.head_dim))

    def _embed(self, tokens: torch.Tensor, offset: int | torch.Tensor) -> torch.Tensor:
        d = self.decoder
        x = d.embed_tokens(tokens)
        pos = d.embed_positions
        positions = torch.arange(tokens.shape[1], device=tokens.device) + offset
        if hasattr(pos, "weights"):  # TrOCR's sinusoidal table: positions start after padding_idx
            x = x + pos.weights.to(x.device)[positions + pos.padding_idx + 1][None]
        else:  # learned, with mBART's / TrOCR's offset of 2
            x = x + F.embedding(positions + pos.offset, pos.weight)[None]
        if getattr(d, "layernorm_embedding", None) is not None:
            x = d.layernorm_embedding(x)
        return x

    def run(self, tokens: torch.Tensor, past: list[torch.Tensor], cross: list[torch.Tensor], causal: bool,
            every: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        offset = past[0].shape[2] if past else 0
        x = self._embed(tokens, offset)
        pre = self.norm == "pre"
        present = []
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            h = layer.self_attn_layer_norm(x) if pre else x
            k, v = self._heads(a.k_proj(h), a), self._heads(a.v_proj(h), a)
            if past:
                k, v = torch.cat([past[2 * i], k], dim=2), torch.cat([past[2 * i + 1], v], dim=2)
            present += [k, v]
            x = x + self._attend(a, h, k, v, offset if causal else None)
            if not pre:
                x = layer.self_attn_layer_norm(x)
            h = layer.encoder_attn_layer_norm(x) if pre else x
            x = x + self._attend(layer.encoder_attn, h, cross[2 * i], cross[2 * i + 1], None)
            if not pre:
                x = layer.encoder_attn_layer_norm(x)
            h = layer.final_layer_norm(x) if pre else x
            x = x + layer.fc2(layer.activation_fn(layer.fc1(h)))
            if not pre:
                x = layer.final_layer_norm(x)
        x = x if every else x[:, -1]
        if getattr(self.decoder, "layer_norm", None) is not None:
            x = self.decoder.layer_norm(x)
        return self.head(x).float(), present


class Gpt2CachedDecoder(nn.Module):
    """A GPT-2 decoder with cross-attention (``add_cross_attention``: ``c_attn`` Conv1Ds, q/k/v fused)
    with its KV cache as plain tensors (:class:`pipeline.adapters.base.CachedDecoder`)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.body = lm.transformer
        self.head = lm.lm_head
        self.layers = self.body.h
        first = self.layers[0].attn
        if first.scale_attn_by_inverse_layer_idx or first.reorder_and_upcast_attn or not first.scale_attn_weights:
            raise PipelineError("GPT-2 decoders with scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn or "
                                "unscaled attention are not supported")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @staticmethod
    def _heads(x: torch.Tensor, attn: nn.Module) -> torch.Tensor:
        return split_heads(x, attn.num_heads, attn.head_dim)

    def cross_kv(self, memory: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for layer in self.layers:
            a = layer.crossattention
            k, v = a.c_attn(memory).split(a.split_size, dim=2)
            out += [self._heads(k, a), self._heads(v, a)]
        return out

    def _attend(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                offset: int | torch.Tensor | None) -> torch.Tensor:
        ctx = attend(self._heads(q, attn), k, v, offset, attn.head_dim)
        return attn.c_proj(merge_heads(ctx, q, attn.num_heads, attn.head_dim))

    def run(self, tokens: torch.Tensor, past: list[torch.Tensor], cross: list[torch.Tensor], causal: bool,
            every: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        offset = past[0].shape[2] if past else 0
        positions = torch.arange(tokens.shape[1], device=tokens.device) + offset
        x = self.body.wte(tokens) + self.body.wpe(positions)[None]
        present = []
        for i, layer in enumerate(self.layers):
            a = layer.attn
            q, k, v = a.c_attn(layer.ln_1(x)).split(a.split_size, dim=2)
            k, v = self._heads(k, a), self._heads(v, a)
            if past:
                k, v = torch.cat([past[2 * i], k], dim=2), torch.cat([past[2 * i + 1], v], dim=2)
            present += [k, v]
            x = x + self._attend(a, q, k, v, offset if causal else None)
            c = layer.crossattention
            x = x + self._attend(c, c.q_attn(layer.ln_cross_attn(x)), cross[2 * i], cross[2 * i + 1], None)
            x = x + layer.mlp(layer.ln_2(x))
        x = self.body.ln_f(x if every else x[:, -1])
        return self.head(x).float(), present


@register_adapter("hf_vision_encoder_decoder")
class HfVisionEncoderDecoderAdapter(ModelAdapter):
    def __init__(self, model: nn.Module, folder: Path, config: dict):
        from pipeline.preprocessing import hf_preprocess_spec, output_shape
        from pipeline.tokenization.hf import HfTokenizer

        self.model = model.eval()
        self.folder = Path(folder)
        self.config = config
        self.tokenizer_path = self.folder / TOKENIZER
        self._bos, self._eos, self._pad = special_ids(config)
        self.tokenizer = HfTokenizer(self.tokenizer_path, self._bos, self._eos, self._pad)
        channels = int(model.config.encoder.num_channels)
        own = json.loads((self.folder / OWN).read_text()) if (self.folder / OWN).is_file() else {}
        if own.get("preprocess"):  # the preprocessing the weights were trained with, when HF's cannot say it
            from pipeline.preprocessing import check_spec

            check_spec(own["preprocess"], f"{OWN} in {self.folder}")
            self._spec = dict(own["preprocess"])
        else:
            self._spec = hf_preprocess_spec(json.loads((self.folder / PREPROCESSOR).read_text()), channels)
        size = model.config.encoder.image_size
        h, w = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
        made = output_shape(self._spec)
        if made != (channels, h, w):
            raise PipelineError(f"{self.folder / PREPROCESSOR}: makes {made[0]}x{made[1]}x{made[2]} images, the "
                                f"encoder takes {channels}x{h}x{w}")
        self._shape = (channels, h, w)

    # ---- loading and saving -------------------------------------------------------------
    @classmethod
    def load(cls, source: str, trust_checkpoint: bool = False) -> "HfVisionEncoderDecoderAdapter":
        from transformers import VisionEncoderDecoderConfig, VisionEncoderDecoderModel

        config = cls._config(source)
        folder = Path(source)
        own = folder / OWN
        try:
            if own.is_file():  # a model this pipeline saved: build, cut the heads it cut, then load
                from safetensors.torch import load_model

                heads = json.loads(own.read_text())["encoder_heads"]
                model = VisionEncoderDecoderModel(config=VisionEncoderDecoderConfig.from_pretrained(folder))
                model.encoder.set_attn_implementation("eager")  # the decoder that is exported is ours
                attns = _encoder_attentions(model)
                if len(heads) != len(attns):
                    raise PipelineError(f"{own}: {len(heads)} head counts for {len(attns)} encoder layers")
                for attn, n in zip(attns, heads):
                    if int(n) < num_heads(attn):
                        remove_hf_heads(attn, list(range(int(n), num_heads(attn))))
                load_model(model, str(folder / WEIGHTS), strict=True)
            else:
                model = VisionEncoderDecoderModel.from_pretrained(folder, use_safetensors=True,
                                                                  attn_implementation="eager")
        except PipelineError:
            raise
        except (OSError, ValueError, RuntimeError, KeyError, TypeError) as exc:
            raise PipelineError(f"{folder}: the model does not load: {str(exc).splitlines()[0]}") from None
        adapter = cls(model.eval(), folder, config)
        policy = json.loads(own.read_text()).get("token_policy") if own.is_file() else None
        if policy is not None:  # a model recovered to read only some of its patch tokens
            from pipeline.tokens.policy import TokenPolicy

            adapter.token_policy = TokenPolicy.from_dict(policy, f"{own}: token_policy")
        return adapter

    def save(self, folder: Path) -> None:
        from safetensors.torch import save_model

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.model.config.save_pretrained(folder)
        save_model(self.model, str(folder / WEIGHTS), metadata={"family": self.family, "format": "pt"})
        for name in (TOKENIZER, PREPROCESSOR):
            if (self.folder / name).resolve() != (folder / name).resolve():  # saved in place: already there
                shutil.copyfile(self.folder / name, folder / name)
        (folder / OWN).write_text(json.dumps({"family": self.family, "encoder_heads": self.encoder_head_counts(),
                                              "preprocess": self._spec,
                                              **({"token_policy": self.token_policy.to_dict()}
                                                 if self.token_policy is not None else {})}, indent=2) + "\n")

    @classmethod
    def _config(cls, source: str) -> dict:
        """The config of the folder ``source`` names, once it is one this adapter reads."""
        if source in ("package", "", None):
            raise PipelineError("model.adapter=hf_vision_encoder_decoder reads a local folder: set model.path "
                                "to a save_pretrained folder")
        return check_folder(Path(source))

    @classmethod
    def check_source(cls, source: str) -> None:
        cls._config(source)

    @classmethod
    def text_tokenizer(cls, source: str):
        from pipeline.tokenization.hf import HfTokenizer

        return HfTokenizer(Path(source) / TOKENIZER, *special_ids(cls._config(source)))

    @classmethod
    def vocabulary(cls, source: str) -> list[str]:
        return cls.text_tokenizer(source).token_strings()

    def source_files(self) -> list[Path]:
        return sorted(p for p in self.folder.iterdir() if p.is_file())

    def tokenizer_kind(self) -> str:
        return "hf"

    # ---- input ------------------------------------------------------------------------------
    @property
    def input_shape(self) -> tuple[int, int, int]:
        return self._shape

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        from pipeline.preprocessing import preprocess

        return torch.from_numpy(np.ascontiguousarray(preprocess(image, self._spec)))

    def preprocess_spec(self) -> dict:
        return dict(self._spec)

    # ---- tokens -------------------------------------------------------------------------------
    @property
    def bos_id(self) -> int:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.decoder.vocab_size)

    @property
    def max_positions(self) -> int | None:
        n = getattr(self.model.config.decoder, "max_position_embeddings", None)
        return int(n) if n else None

    def banned_token_ids(self) -> list[int]:
        # TrOCR starts decoding with EOS (</s>): never ban the token that ends a reading
        return [i for i in dict.fromkeys([self.pad_id, self.bos_id]) if i != self.eos_id]

    def encode_text(self, latex: str) -> list[int]:
        return self.tokenizer.encode(latex)

    def decode_text(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def decoder_parameters(self) -> list[nn.Parameter]:
        # what reads the memory and writes tokens: the encoder-to-decoder projection (if any) and the decoder
        proj = getattr(self.model, "enc_to_dec_proj", None)
        return [*(proj.parameters() if proj is not None else []), *self.model.decoder.parameters()]

    def vocabulary_parameters(self) -> list[nn.Parameter]:
        return list(dict.fromkeys([self.model.decoder.get_input_embeddings().weight,
                                   *self.model.decoder.get_output_embeddings().parameters()]))

    def cross_attention_parameters(self) -> list[nn.Parameter]:
        if DECODERS[self.model.config.decoder.model_type] == "gpt2":
            return [p for layer in self.model.decoder.transformer.h
                    for p in (*layer.ln_cross_attn.parameters(), *layer.crossattention.parameters())]
        return [p for layer in self.model.decoder.model.decoder.layers
                for p in (*layer.encoder_attn_layer_norm.parameters(), *layer.encoder_attn.parameters())]

    # ---- compute ------------------------------------------------------------------------------
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        if self.token_policy is not None:
            return self.encode_kept(images, self.keep_indices(images))
        memory = self.model.encoder(pixel_values=images.to(self.device)).last_hidden_state
        proj = getattr(self.model, "enc_to_dec_proj", None)
        return proj(memory) if proj is not None else memory

    def encode_kept(self, images: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """The encoder on its special tokens (ViT's class token, DeiT's two; I-JEPA has none), always kept,
        and the kept patches: the embeddings gathered, then the layers and the final LayerNorm."""
        enc = self.model.encoder
        x = enc.embeddings(images.to(self.device))
        specials = x.shape[1] - self._grid()[0] * self._grid()[1]
        keep = keep.to(x.device)
        index = torch.cat([torch.arange(specials, device=x.device).expand(keep.shape[0], -1), keep + specials], 1)
        x = torch.gather(x, 1, index[:, :, None].expand(-1, -1, x.shape[-1]))
        # ViTModel.forward's loop (no attention mask: every token is real)
        x = self.encoder_layers(x, enc.layers, specials, lambda layer, h: layer(h, None))
        x = enc.layernorm(x)
        proj = getattr(self.model, "enc_to_dec_proj", None)
        return proj(x) if proj is not None else x

    def _grid(self) -> tuple[int, int]:
        p = int(self.model.config.encoder.patch_size)
        return self._shape[1] // p, self._shape[2] // p

    def token_grid(self) -> tuple[int, int, int] | None:
        if self.token_policy_refusal_reason() is not None:
            return None
        return (*self._grid(), int(self.model.config.encoder.patch_size))

    def token_policy_refusal_reason(self) -> str | None:
        spec = self._spec
        if len(set(spec.get("image_mean", [0.0]))) > 1 or len(set(spec.get("image_std", [1.0]))) > 1:
            return (f"a token policy reads ink on one grey scale; {self.folder.name}'s image processor normalizes each "
                    f"channel differently (image_mean {spec['image_mean']}, image_std {spec['image_std']})")
        if not all(hasattr(self.model.encoder, n) for n in ("embeddings", "layers", "layernorm")):
            return (f"{type(self.model.encoder).__name__} has no embeddings, layers and final LayerNorm to read a "
                    f"subset of its tokens through")
        return None

    def token_policy_refusal(self) -> str:
        return self.token_policy_refusal_reason() or super().token_policy_refusal()

    def preprocessed_level(self, level: float) -> float:
        spec = self._spec
        x = level * 255.0 * float(spec["rescale_factor"]) if spec["do_rescale"] else level * 255.0
        if spec["do_normalize"]:
            x = (x - float(spec["image_mean"][0])) / float(spec["image_std"][0])
        return x

    def decode_logits(self, tokens: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        out = self.model.decoder(input_ids=tokens.to(self.device), encoder_hidden_states=memory.to(self.device),
                                 use_cache=False)
        return out.logits.float()

    def cached_decoder(self) -> nn.Module:
        layout = DECODERS[self.model.config.decoder.model_type]
        if layout == "gpt2":
            return Gpt2CachedDecoder(self.model.decoder).eval()
        return HfCachedDecoder(self.model.decoder, layout).eval()

    # ---- structure ------------------------------------------------------------------------------
    def encoder_head_counts(self) -> list[int]:
        return [num_heads(a) for a in _encoder_attentions(self.model)]

    def encoder_attention(self, layer: int) -> nn.Module:
        return _encoder_attentions(self.model)[layer]

    def remove_encoder_heads(self, heads: dict[int, Sequence[int]]) -> None:
        attns = _encoder_attentions(self.model)
        for layer, remove in heads.items():
            if remove:
                remove_hf_heads(attns[int(layer)], list(remove))


def _encoder_attentions(model: nn.Module) -> list[nn.Module]:
    """Each encoder layer's self-attention (ViT / DeiT: ``layers[i].attention``)."""
    return [layer.attention for layer in model.encoder.layers]
