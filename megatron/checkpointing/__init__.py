"""Checkpoints: save/load through DeepSpeed, commit marker, retention, layout change, preemption.

The package holds a handful of concepts:

* save/load: ``save_load.py`` (one checkpoint through the DeepSpeed engine, the RNG state beside it),
  ``new_parameters.py`` (loading into a model with parameters the checkpoint lacks: a value head, LoRA
  adapters), ``expert_shards.py`` (experts split over data-parallel ranks), ``safe_load.py`` (weights-only
  ``torch.load``), ``partitioned_load.py`` (a converter's weights-only checkpoint into a ZeRO-3 model);
* the run's checkpoints: ``manager.py`` (``CheckpointManager`` owns one run's save directory, retention and
  preemption flag; ``CheckpointHooks`` adapts it to the training loop, wired by ``pretrain``),
  ``preemption.py``;
* retention and commit: ``commit.py`` (the commit marker, ``latest``, the retention policy), no torch;
* layout change: ``layout.py`` (the rules, no torch), ``universal.py`` (DeepSpeed's universal checkpoints;
  ``convert.py`` runs its converter), ``reshard.py`` and ``local_weights.py`` (Deepy's own resharding);
* formats: ``neox/`` (GPT-NeoX's checkpoint format: names, file layout, QKV order, read and write);
  Hugging Face interop is ``megatron/interop``;
* before launch: ``config.py`` (the keys), ``resume_checks.py`` (the checks of those keys and of the
  checkpoint to be loaded), ``discovery.py`` (what a ``load`` directory holds), no torch.

Nothing is imported here: ``commit`` and ``discovery`` only look at files, and ``deepy.py`` uses
them before launching (whether a run has anything left to do) without paying for DeepSpeed's import.
"""
