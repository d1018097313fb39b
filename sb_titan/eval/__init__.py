"""Accuracy evaluation: LongBench (official metrics), key-value retrieval, greedy decoding
with a KV cache, and checkpoint loading (DCP or Hugging Face)."""
