"""Text generation and sequence scoring over our model under tensor and pipeline parallelism.

* `config.py`     `TextgenArgs` (the textgen keys), `checked` (what generate.py reads, from the groups
                  declaring it), `SamplingParams` (one request's sampling).
* `sampling.py`   greedy, temperature, top-k, top-p on full-vocabulary logits.
* `replica.py`    `ModelReplica`: this rank's stage of one model copy as tokens -> logits
                  (send/recv between pipeline stages, vocab-parallel helpers).
* `decode.py`     `generate`: batched, KV-cached decoding that stops at EOD.
* `scoring.py`    `score`: log-probabilities of given sequences (precompute, lm-eval).
* `modes.py`      unconditional / input-file / interactive drivers and their jsonl output.
* `precompute.py` reference log-prob datasets for DPO/KTO: the writer and its reader.
* `loading.py`    the newest committed checkpoint's weights, read whole and cut to this rank (no training engine).
* `entry.py`      generate.py's per-rank main and the inference model set-up shared with eval.py.
"""
