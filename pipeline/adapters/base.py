"""The model adapter interface: everything a stage needs to know about a model family.

Stages never test ``isinstance`` on model classes; they ask the adapter. One adapter per family
(packed ``nn.MultiheadAttention``, HF q/k/v ``Linear``s, timm's fused ``qkv`` ...), registered by
name and chosen with ``model.adapter``.
"""
from __future__ import annotations

import abc
import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Protocol, Sequence, runtime_checkable

import numpy as np
import torch
from PIL import Image
from torch import nn

from pipeline import interrupts
from pipeline.adapters.attention import keys_weighted, proportional_bias, stand_for
# DecodeResult lives beside the loops that fill it (torch-free: the package runtime and Triton's model read it)
from pipeline.decoding import DecodeResult, LayoutGuard, greedy  # noqa: F401
from pipeline.errors import PipelineError
from pipeline.tokens.policy import reading_batches

_ADAPTERS: dict[str, type["ModelAdapter"]] = {}


def register_adapter(name: str) -> Callable[[type["ModelAdapter"]], type["ModelAdapter"]]:
    def deco(cls: type[ModelAdapter]) -> type[ModelAdapter]:
        cls.family = name
        _ADAPTERS[name] = cls
        return cls
    return deco


def adapter_class(name: str) -> type["ModelAdapter"]:
    _import_builtin_adapters()
    if name not in _ADAPTERS:
        raise PipelineError(f"unknown model adapter {name!r}; known: {sorted(_ADAPTERS)}")
    return _ADAPTERS[name]


# the adapters that ship with the pipeline, by name: imported when asked for (each registers itself),
# so this interface module never imports an implementation of it
BUILTIN_ADAPTERS = {"latex_ocr_junia": "pipeline.adapters.latex_ocr_junia",
                    "hf_vision_encoder_decoder": "pipeline.adapters.hf_vision_encoder_decoder"}


def _import_builtin_adapters() -> None:
    import importlib

    for module in BUILTIN_ADAPTERS.values():
        importlib.import_module(module)


@runtime_checkable
class CachedDecoder(Protocol):
    """What :meth:`ModelAdapter.cached_decoder` returns: the decoder with a KV cache, as export traces
    it into ``decoder_first`` / ``decoder_step`` / ``decoder_verify`` (pipeline/export/graphs.py).

    Tensors: memory [B, N, D]; per layer a key and a value [B, H, S, d], listed k0, v0, k1, v1 ...
    """

    num_layers: int

    def cross_kv(self, memory: torch.Tensor) -> list[torch.Tensor]:
        """The cross-attention keys and values of the memory, per layer (computed once a formula)."""
        ...

    def run(self, tokens: torch.Tensor, past: list[torch.Tensor], cross: list[torch.Tensor], causal: bool,
            every: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """tokens [B, T] after ``past`` ([] = none) -> logits [B, V] after the last token (``every``:
        [B, T, V]), and the present self-attention keys and values (past + T tokens). ``causal``: token
        i reads keys up to its own position; a lone new token reads them all."""
        ...



@dataclass(frozen=True)
class SmoothPair:
    """One of SmoothQuant's places an adapter declares (:meth:`ModelAdapter.smoothing_pairs`; the fold:
    :mod:`pipeline.quantization.smooth`)."""
    name: str                 # the consumers' common label, e.g. "encoder_blocks.0.attn.qkv"
    producer: nn.Module       # nn.LayerNorm (scale and shift) or nn.Linear (output rows)
    consumers: tuple[nn.Linear, ...]  # projections whose input channels are the producer's outputs

class ModelAdapter(abc.ABC):
    """One trained image -> LaTeX model, with the knowledge to run and reshape it."""

    family: ClassVar[str] = ""
    model: nn.Module

    # ---- loading and saving -------------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def load(cls, source: str, trust_checkpoint: bool = False) -> "ModelAdapter":
        """``source``: ``"package"`` for the shipped weights, or a folder written by :meth:`save`."""

    @classmethod
    def check_source(cls, source: str) -> None:
        """Raise ``PipelineError`` (one line) when :meth:`load` could not read ``source``, without reading
        the weights: what the command line checks before any stage runs. Default: nothing to check."""

    @abc.abstractmethod
    def save(self, folder: Path) -> None:
        """Write safetensors weights plus a JSON config that :meth:`load` reads back."""

    @classmethod
    def text_tokenizer(cls, source: str) -> Any:
        """The tokenizer of the model at ``source`` (as :meth:`load` takes it), read without the
        weights: ``encode(text)`` -> ids (BOS ... EOS), ``decode(ids)`` -> text, ``vocab_size``.
        The tokenizer stage compares its formula BPE with it."""
        raise PipelineError(f"model adapter {cls.family!r} does not give its tokenizer without the model")

    @classmethod
    def vocabulary(cls, source: str) -> list[str]:
        """The output vocabulary of the model at ``source``, token strings in id order: what the
        tokenizer stage trains a formula BPE beside (every character the model writes stays one atom)."""
        raise PipelineError(f"model adapter {cls.family!r} does not declare its vocabulary")

    # the tokenizer file an exported package ships (the runtime reads it by ``tokenizer_kind``)
    tokenizer_path: Path

    def tokenizer_kind(self) -> str:
        """How the runtime reads :attr:`tokenizer_path` (pipeline/export/runtime.py): ``char`` (the
        default model's vocabulary), ``bpe`` (the formula BPE of stage distill's student) or ``hf`` (any
        HF ``tokenizers`` JSON, with the package's own special ids)."""
        from pipeline.tokenization.bpe import is_bpe_file

        return "bpe" if is_bpe_file(self.tokenizer_path) else "char"

    def source_files(self) -> list[Path]:
        """The files the model was loaded from (its size on disk as shipped); [] when not known."""
        return []

    # ---- input ------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def input_shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of one preprocessed image."""

    @abc.abstractmethod
    def preprocess(self, image: Image.Image) -> torch.Tensor:
        """The inference preprocessing: any PIL image -> one model input tensor [C, H, W]."""

    def preprocess_spec(self) -> dict:
        """:meth:`preprocess` described as data, for a runtime that has no torch or adapter."""
        from pipeline.errors import PipelineError
        raise PipelineError(f"model family {self.family!r} does not describe its preprocessing")

    # ---- tokens -------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def bos_id(self) -> int: ...

    @property
    @abc.abstractmethod
    def eos_id(self) -> int: ...

    @property
    @abc.abstractmethod
    def pad_id(self) -> int: ...

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Token ids are 0 .. vocab_size - 1 (the decoder's output width)."""

    @abc.abstractmethod
    def encode_text(self, latex: str) -> list[int]:
        """Target token ids for ``latex``: BOS ... EOS (for training and teacher forcing)."""

    @abc.abstractmethod
    def decode_text(self, ids: Iterable[int]) -> str: ...

    def with_bpe(self, tokenizer_path: Path) -> "ModelAdapter":
        """A copy whose decoder speaks the BPE in ``tokenizer_path`` (an HF ``tokenizers`` JSON), each
        new token's rows built from the char pieces it is made of (stage distill's student)."""
        raise PipelineError(f"model family {self.family!r} cannot take a new token vocabulary")

    def decoder_parameters(self) -> list[nn.Parameter]:
        """The parameters stage distill trains (everything after the encoder)."""
        raise PipelineError(f"model family {self.family!r} does not say which parameters its decoder has")

    def vocabulary_parameters(self) -> list[nn.Parameter]:
        """The decoder's parameters with one row per token (embedding, output layer): what
        :meth:`with_bpe` builds anew; the rest of :meth:`decoder_parameters` is copied."""
        raise PipelineError(f"model family {self.family!r} does not say which parameters hold its vocabulary")

    def cross_attention_parameters(self) -> list[nn.Parameter]:
        """The decoder's attention over the encoder output, its norms included: what
        ``distill.freeze_cross_attention`` keeps as the char model learnt it."""
        raise PipelineError(f"model family {self.family!r} does not say which parameters read the encoder output")

    def clone(self) -> "ModelAdapter":
        """A copy with its own model (a deep copy of the weights; the rest shared): what a stage changes
        (heads removed, keys pooled, fake quantizers) while the original stays as it is."""
        twin = copy.copy(self)
        twin.model = copy.deepcopy(self.model)
        return twin

    # ---- compute ------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where the model's weights are (inputs are moved there: pipeline/device.py places models)."""
        return next((p.device for p in self.model.parameters()), torch.device("cpu"))

    @abc.abstractmethod
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images [B, C, H, W] -> encoder memory [B, N, D]."""

    @abc.abstractmethod
    def decode_logits(self, tokens: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        """Full-prefix decoder: tokens [B, T] and memory -> logits [B, T, V]."""

    def banned_token_ids(self) -> list[int]:
        return [self.pad_id, self.bos_id]

    # which patch tokens the encoder reads (pipeline/tokens/policy.py); None: all. Set on a model that was
    # recovered to read with it (stage prune, prune.tokens), saved with it, exported into its package
    token_policy: Any = None

    def token_grid(self) -> tuple[int, int, int] | None:
        """Rows, columns and pixel size of the patch grid whose tokens a policy may drop, or None when the
        family's encoder cannot read a subset (the reason: :meth:`token_policy_refusal`)."""
        return None

    def token_policy_refusal(self) -> str:
        """Why this family cannot read a subset of its tokens (one line)."""
        return f"model family {self.family!r} has no way to read a subset of its patch tokens"

    def set_token_policy(self, settings: dict | None) -> None:
        """Read only the tokens :class:`~pipeline.tokens.policy.TokenPolicy` keeps (``settings``: its
        dilate / frame_stride / buckets / ink_below; None: every token again)."""
        from pipeline.tokens.policy import INK_BELOW, for_grid

        if settings is None:
            self.token_policy = None
            return
        grid = self.token_grid()
        if grid is None:
            raise PipelineError(self.token_policy_refusal())
        settings = dict(settings)  # ink_below: a grey level (0..1), on the scale the encoder's inputs have
        settings["ink_below"] = self.preprocessed_level(float(settings.get("ink_below", INK_BELOW)))
        policy = for_grid(*grid, settings)
        if policy.proportional and not self.reads_proportional():
            raise PipelineError(f"token policy: proportional attention needs an encoder attention that takes a bias on "
                                f"its scores; the '{self.family}' adapter's does not (prune.tokens.proportional=false)")
        layers = len(self.encoder_head_counts())
        if policy.narrow_from >= layers:
            raise PipelineError(f"token policy: narrow_from={policy.narrow_from}, but the encoder has {layers} layers "
                                f"(0 .. {layers - 1}; 0: no narrowing)")
        self.token_policy = policy

    def preprocessed_level(self, level: float) -> float:
        """A grey level (0 black .. 1 white) on the preprocessed images' scale (the default: the same)."""
        return level

    def encode_kept(self, images: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Images [B, C, H, W] and kept patch indices [B, K] -> memory [B, K, D] (families with a token grid)."""
        raise NotImplementedError(self.token_policy_refusal())

    def encoder_layers(self, x: torch.Tensor, layers: Sequence[torch.nn.Module], specials: int = 0,
                       call: Callable = lambda layer, x: layer(x), keep: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [B, S + K, D] through the encoder's ``layers``. From the policy's ``narrow_from`` on only
        the S special tokens and the first ``narrowed(K)`` kept patches (by rank: ink, neighbours, frame) go
        through the layers; the last ``narrow_by`` (filler) skip them and join the memory as they were. With
        ``keep`` ([B, K] kept patch indices) and a proportional policy, every layer's attention weighs a kept
        patch as the patches it stands for (:func:`~pipeline.adapters.attention.proportional_bias`)."""
        policy = self.token_policy
        bias = None
        if policy is not None and policy.proportional and keep is not None:
            bias = proportional_bias(stand_for(keep.to(x.device), policy.grid_h, policy.grid_w), specials)
        start = policy.narrow_from if policy is not None and policy.narrows else len(layers)
        with keys_weighted(layers, bias):
            for layer in layers[:start]:
                x = call(layer, x)
        if start == len(layers):
            return x
        k = specials + policy.narrowed(x.shape[1] - specials)
        head, tail = x[:, :k], x[:, k:]
        for layer in layers[start:]:
            head = call(layer, head)
        return torch.cat([head, tail], 1)

    def reads_proportional(self) -> bool:
        """Whether the encoder's attention can weigh kept patches (a token policy's ``proportional``): the
        default family's can; a family whose attention takes no bias says no."""
        return False

    def kept_memory(self, memory: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """An encoder's memory over every token [B, S + patches, D] at the tokens this model's policy keeps,
        laid out as :meth:`encode_kept` lays them: the S special tokens first (a ViT's class token, DeiT's
        two; the default family none), always kept, then the patches ``keep`` [B, K] -> [B, S + K, D]."""
        specials = memory.shape[1] - self.token_policy.num_patches
        index = torch.cat([torch.arange(specials, device=keep.device).expand(keep.shape[0], -1), keep + specials], 1)
        return torch.gather(memory, 1, index[:, :, None].expand(-1, -1, memory.shape[-1]))

    def keep_indices(self, images: torch.Tensor) -> torch.Tensor:
        """[B, K] kept patch indices of ``images`` under the model's token policy (host-side numpy)."""
        keep = self.token_policy.keep_batch(images.detach().float().cpu().numpy())
        return torch.from_numpy(keep).to(images.device)

    # greedy decoding's cap on runs of layout-only LaTeX (pipeline/decoding.py); 0 = none. The
    # context sets it from model.layout_run_cap when it loads a model; export writes it to the package
    layout_run_cap: int = 0

    def layout_guard(self) -> LayoutGuard | None:
        if not self.layout_run_cap:
            return None
        built = getattr(self, "_layout_guard", None)
        if built is None or built.cap != self.layout_run_cap:  # one per vocabulary and cap
            built = self._layout_guard = LayoutGuard.for_vocabulary(
                lambda i: self.decode_text([i]), self.vocab_size, self.eos_id, self.layout_run_cap)
        return built

    @property
    def max_positions(self) -> int | None:
        """The longest token sequence (BOS included) the decoder's position table holds; None: no limit."""
        return None

    def cached_decoder(self) -> CachedDecoder | None:
        """A KV-cached decoder (``cross_kv(memory)``, ``run(tokens, past, cross, causal)``), or None.

        The shipped decoder re-runs the whole prefix (and re-projects the encoder memory) at every
        step; the cached one computes the same function in O(1) per step.
        """
        return None

    @torch.no_grad()
    def generate(self, images: torch.Tensor, max_length: int, batch_size: int = 16,
                 progress: Callable[[int], None] | None = None, use_cache: bool = False,
                 encoded: bool = False) -> DecodeResult:
        """Greedy decoding in batches; finished rows leave the batch so they cost nothing.

        ``max_length`` caps the sequence including BOS, as the package's own ``generate`` does.
        ``use_cache``: decode with the adapter's KV-cached decoder (same function, far fewer FLOPs);
        the default re-runs the whole prefix at each step, as the shipped model does. ``encoded``:
        ``images`` are encoder outputs already (cached memory), decoded as they are.
        """
        self.model.eval()
        cached = self.cached_decoder() if use_cache else None
        if use_cache and cached is None:
            raise ValueError(f"adapter {self.family!r} has no KV-cached decoder")
        all_ids: list[list[int]] = []
        steps: list[int] = []
        capped: list[bool] = []
        enc_s = dec_s = 0.0
        dev = self.device
        banned = self.banned_token_ids()
        guard = self.layout_guard()
        policy = None if encoded else self.token_policy  # each batch of one bucket, as the package reads
        host = images if policy is None else images.detach().float().cpu().numpy()
        order: list[int] = []
        for rows in reading_batches(host, batch_size, policy):
            order += rows
            batch = images[rows]
            t0 = time.perf_counter()
            memory = batch.float().to(dev) if encoded else self.encode(batch)
            t1 = time.perf_counter()
            n = batch.shape[0]
            out = greedy(*self._greedy_steps(memory, cached), n, self.eos_id, banned, max_length, guard)
            t2 = time.perf_counter()
            enc_s += t1 - t0
            dec_s += t2 - t1
            for ids in out:
                assert ids is not None
                all_ids.append(ids)
                steps.append(len(ids))
                capped.append(not ids or ids[-1] != self.eos_id)
            if progress is not None:
                progress(n)
            interrupts.check()  # a signal a native callback swallowed ends the reading here
        back = np.argsort(order, kind="stable")  # each image's reading where the image came
        all_ids, steps, capped = ([seq[i] for i in back] for seq in (all_ids, steps, capped))
        texts = [self.decode_text(ids) for ids in all_ids]
        return DecodeResult(all_ids, texts, enc_s, dec_s, steps, capped)

    def _greedy_steps(self, memory: torch.Tensor, cached) -> tuple[Callable, Callable, Callable]:
        """This model's step functions for :func:`pipeline.decoding.greedy`: the whole prefix re-run
        each step (the shipped decoder), or ``cached``'s KV-cached run; logits to the host as float32."""
        state = {"seqs": torch.full((memory.shape[0], 1), self.bos_id, dtype=torch.long, device=memory.device),
                 "memory": memory, "past": [], "cross": cached.cross_kv(memory) if cached is not None else []}

        def logits() -> np.ndarray:
            if cached is None:
                out = self.decode_logits(state["seqs"], state["memory"])[:, -1, :]
            else:
                seqs = state["seqs"]
                out, state["past"] = cached.run(seqs[:, -1:] if state["past"] else seqs, state["past"],
                                                state["cross"], causal=True)
            return out.float().cpu().numpy()

        def step(tokens: np.ndarray) -> np.ndarray:
            state["seqs"] = torch.cat([state["seqs"], torch.as_tensor(tokens, device=memory.device)[:, None]], dim=1)
            return logits()

        def keep(rows: np.ndarray) -> None:
            mask = torch.as_tensor(rows, device=memory.device)
            state["seqs"], state["memory"] = state["seqs"][mask], state["memory"][mask]
            state["past"] = [t[mask] for t in state["past"]]
            state["cross"] = [t[mask] for t in state["cross"]]

        return logits, step, keep

    # ---- structure (for pruning) --------------------------------------------------------------
    @abc.abstractmethod
    def encoder_head_counts(self) -> list[int]:
        """Number of attention heads in each encoder layer, in order."""

    @abc.abstractmethod
    def encoder_attention(self, layer: int) -> nn.Module:
        """The attention module of encoder layer ``layer`` (explicit q/k/v/out projections)."""

    @abc.abstractmethod
    def remove_encoder_heads(self, heads: dict[int, Sequence[int]]) -> None:
        """Physically remove heads (original indices within the *current* layer) in place."""

    def encoder_mlp(self, layer: int) -> tuple[nn.Linear, nn.Linear]:
        """Encoder layer ``layer``'s MLP: its widening projection and the one back (``fc2``), whose hidden
        units :meth:`narrow_encoder_mlp` removes. ``NotImplementedError`` when the adapter cannot (the stage
        names it in one line)."""
        raise NotImplementedError(f"{type(self).__name__} cannot narrow its encoder's MLP")

    def narrows_mlp(self) -> bool:
        """Whether this family can narrow its encoder's MLP (:meth:`encoder_mlp`)."""
        try:
            self.encoder_mlp(0)
        except NotImplementedError:
            return False
        return True

    def encoder_mlp_widths(self) -> list[int]:
        """Hidden units of each encoder layer's MLP, in order."""
        return [int(self.encoder_mlp(l)[0].out_features) for l in range(len(self.encoder_head_counts()))]

    def narrow_encoder_mlp(self, units: dict[int, Sequence[int]]) -> None:
        """Keep only ``units[l]`` (indices within the *current* layer) of encoder layer ``l``'s MLP hidden
        units, in place: the widening projection's rows, the projection back's columns."""
        for layer, keep in units.items():
            fc1, fc2 = self.encoder_mlp(int(layer))
            idx = torch.as_tensor(sorted(int(u) for u in keep), dtype=torch.long)
            if not len(idx) or int(idx[-1]) >= fc1.out_features or int(idx[0]) < 0:
                raise ValueError(f"encoder layer {layer}: MLP units {list(keep)[:4]}... do not fit its "
                                 f"{fc1.out_features}")
            with torch.no_grad():
                fc1.weight = nn.Parameter(fc1.weight[idx].clone())
                if fc1.bias is not None:
                    fc1.bias = nn.Parameter(fc1.bias[idx].clone())
                fc2.weight = nn.Parameter(fc2.weight[:, idx].clone())
            fc1.out_features = fc2.in_features = len(idx)

    def encoder_key_pools(self) -> list[list[int]]:
        """Each encoder layer's key/value pooling window ([rows, cols] of patches; [1, 1] = none)."""
        return [[1, 1] for _ in self.encoder_head_counts()]

    def pool_encoder_keys(self, windows: dict[int, Sequence[int]]) -> None:
        """Make encoder layer ``l``'s self-attention attend to the means of ``windows[l]`` ([rows,
        cols] of patches) of its keys and values, in place (``ExplicitAttention.pool_keys``).
        ``NotImplementedError`` when the adapter cannot (the stage names it in one line)."""
        if windows:
            raise NotImplementedError(f"{type(self).__name__} cannot pool encoder keys")

    def smoothing_pairs(self) -> list[SmoothPair]:
        """SmoothQuant's places (:mod:`pipeline.quantization.smooth`): each encoder module whose output
        channels are the input channels of some projections, with those projections. None by default
        (stage quantize then refuses ``quantize.smoothquant``)."""
        return []

    def encoder_module(self) -> nn.Module:
        """The image -> memory part, as a module (for FLOP counting and export)."""
        return EncoderModule(self).eval()


class EncoderModule(nn.Module):
    """``owner.encode`` as an ``nn.Module`` holding ``owner.model`` (any object with both); with ``keep``
    (kept patch indices [B, K]), ``owner.encode_kept``."""

    def __init__(self, owner: Any) -> None:
        super().__init__()
        self.model = owner.model
        self._encode = owner.encode
        self._encode_kept = getattr(owner, "encode_kept", None)

    def forward(self, images: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        return self._encode(images) if keep is None else self._encode_kept(images, keep)


def load_adapter(family: str, source: str, trust_checkpoint: bool = False) -> ModelAdapter:
    return adapter_class(family).load(source, trust_checkpoint=trust_checkpoint)
