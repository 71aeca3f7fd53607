"""The applications on top of every component: ``deepy.py``'s command (:mod:`megatron.app.deepy`).

Nothing below imports this package: it composes the argument layer (``neox_arguments``), the
launcher, the checkpoint discovery and the memory estimate into what a user runs.
"""
