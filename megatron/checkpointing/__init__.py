"""Checkpoints: save/load through DeepSpeed, commit marker, retention, layout change, preemption.

``manager.CheckpointManager`` owns one run's save directory, retention and preemption flag;
``hooks.CheckpointHooks`` adapts it to the training loop (``pretrain`` wires it explicitly).

Nothing is imported here: ``commit`` and ``discovery`` only look at files, and ``deepy.py`` uses
them before launching (whether a run has anything left to do) without paying for DeepSpeed's import.
"""
