"""Command-line tools around the trainer: data (``tools.datasets``), checkpoints (``tools.ckpts``),
benchmarks (``tools.bench``) and ``tools.plot_metrics``.

A package so that its tools import each other and run as modules from the repository root
(``python -m tools.datasets.preprocess_data ...``) or as the console scripts ``setup.py`` declares;
``python tools/datasets/preprocess_data.py ...`` works too once the project is installed
(``pip install -e .``).
"""
