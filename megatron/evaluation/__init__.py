"""Evaluation with lm-evaluation-harness (eval.py).

* `config.py`          `EvalConfig`: eval_tasks, eval_results_prefix and what they need, typed.
* `lm_eval_adapter.py` `DeepyLM`: our model as the harness' `LM`, data-parallel over replicas.
* `harness.py`         running the tasks, writing results JSON, samples and the metrics.jsonl row.
* `entry.py`           eval.py's per-rank main.
"""
