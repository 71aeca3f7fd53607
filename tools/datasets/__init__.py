"""Dataset tools: tokenize jsonl into memory-mapped datasets, train tokenizers, merge and count."""
