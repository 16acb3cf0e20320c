"""Model adapters: one per model family, behind :class:`pipeline.adapters.base.ModelAdapter`."""
from pipeline.adapters.base import DecodeResult, ModelAdapter, adapter_class, load_adapter, register_adapter

__all__ = ["DecodeResult", "ModelAdapter", "adapter_class", "load_adapter", "register_adapter"]
