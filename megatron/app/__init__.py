"""The applications on top of every component: ``deepy.py``'s command (:mod:`megatron.app.deepy`) and what
``generate.py`` and ``eval.py`` run on each rank (:mod:`megatron.app.workers`).

Nothing below imports this package: it composes the argument layer (``neox_arguments``), the
launcher, the checkpoint discovery and the memory estimate into what a user runs, and hands the ranks'
components their typed parts of the resolved config.
"""
