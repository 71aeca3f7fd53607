"""Evaluation with lm-evaluation-harness (eval.py).

* `config.py`          `EvalArgs` (eval_tasks, eval_results_prefix) and `EvalRun`, the groups evaluation reads.
* `checks.py`          before-launch checks of eval_tasks (layouts, objective, task files and names).
* `lm_eval_adapter.py` `DeepyLM`: our model as the harness' `LM`, data-parallel over replicas.
* `harness.py`         running the tasks, writing results JSON, samples and the metrics.jsonl row.
* `entry.py`           eval.py's per-rank main.
"""
