"""The engine layer: what builds a model ready to run, below both the trainer and generation.

``build.py`` builds the model (``build_model``: the plain ``GPTModel`` or the pipeline's stages, LoRA,
compiled and checkpointed blocks) and wraps it with the optimizer and the LR schedule in a DeepSpeed
engine (``build_engine``), with Deepy's installs on that engine (fp32 clipping, the tensor-parallel
partial-gradient sum, the GPT-NeoX checkpoint layout). Its pieces, one concept a module: the engine's own
keys and what it reads of the run (``config.py``, ``engine_config.py``), activation checkpointing's keys
(``activation_config.py``), the optimizers and their keys (``optimizers.py``, ``optimizer_config.py``,
``optimizer_block.py``, ``optimizer_checks.py``), the LR schedules and their keys (``lr_schedules.py``,
``lr_neox.py``, ``lr_dialects.py``, ``lr_config.py``), MoE's and hybrid sharding's engine sides
(``moe.py``, ``hybrid_shard.py``), what ``compile_layers`` needs of the machine (``compile_checks.py``),
what each rank sets for itself before building (``process.py``). What the built engine costs is counted
here too, without building it: the memory estimate (``memory.py``), ZeRO's shards (``zero_shards.py``),
the communication per step (``comm_volume.py``) and every rank's part built on fake devices
(``rehearsal.py``).

Training (``megatron/training/``) and generation (``megatron/generation/``) both build through this
package and neither imports the other; this package imports neither (``tests/unit/test_import_graph.py``:
``LAYERS``). The objectives it builds a pipeline's loss from are their own package one layer down
(``megatron/objectives/``).

The package itself imports nothing: the argument schema (which ``deepy.py --dry-run`` loads without torch
or DeepSpeed) is composed of the key groups declared here, so DeepSpeed is imported by ``build.py`` only.
"""
