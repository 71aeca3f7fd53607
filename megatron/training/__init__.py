"""The trainer: ``pretrain(run)``, the loop, optimizers and LR schedules from config registries.

Import ``megatron.training.pretrain`` for the entry point; this package itself stays cheap to import
(no DeepSpeed engine) for tools and unit tests that only need schedules or optimizers.
"""
