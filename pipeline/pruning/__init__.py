"""Attention-head pruning for the encoder: head scores, selection, recovery (in rounds), counting, and
what stage prune measures of a model.

Everything here works on attention modules that expose ``q_proj``/``k_proj``/``v_proj`` and an
output projection (``out_proj`` or ``o_proj``) as ``nn.Linear``s, with ``num_heads`` and
``head_dim``: the project's :class:`~pipeline.adapters.attention.ExplicitAttention` and the
HF-style views of :mod:`pipeline.adapters.hf_vit`. A head is a slice of rows of q/k/v and of
columns of the output projection.
"""
