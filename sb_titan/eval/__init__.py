"""Accuracy evaluation: LongBench (official metrics), key-value retrieval, RULER's
needle-in-a-haystack tasks, greedy decoding with a KV cache, and checkpoint loading (DCP
or Hugging Face)."""
