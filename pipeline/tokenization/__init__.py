"""Formula tokenization: the LaTeX atom grammar and the ``tokenizers`` normalizer/pre-tokenizer built
on it (``atoms``), atom-aware BPE training and the baselines (``train``), the LRU-cached serving
encoder (``serving``), and the measurements and report of stage tokenizer (``compare``, ``report``).
See docs/tokenizer.md."""
