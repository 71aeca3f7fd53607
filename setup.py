"""Deepy: a GPT-NeoX-style trainer for large language models (tensor, pipeline and ZeRO parallelism)."""

from pathlib import Path

from setuptools import find_packages, setup


def _requirements(name: str) -> list[str]:
    lines = (Path(__file__).parent / "requirements" / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


# The tools under tools/ as commands on PATH once installed. Each still runs as
# ``python tools/datasets/preprocess_data.py`` (installed) and ``python -m tools.datasets.preprocess_data``
# (from the repository root, installed or not); deepy.py, train.py, generate.py and eval.py stay scripts
# beside the packages, as in GPT-NeoX.
CONSOLE_SCRIPTS = [
    "deepy-preprocess-data = tools.datasets.preprocess_data:cli",
    "deepy-preprocess-data-with-mask = tools.datasets.preprocess_data_with_mask:cli",
    "deepy-build-preference-data = tools.datasets.build_preference_data:cli",
    "deepy-train-tokenizer = tools.datasets.train_tokenizer:cli",
    "deepy-merge-datasets = tools.datasets.merge_datasets:cli",
    "deepy-dataset-token-count = tools.datasets.dataset_token_count:cli",
    "deepy-convert-neox-to-hf = tools.ckpts.convert_neox_to_hf:cli",
    "deepy-convert-hf-to-neox = tools.ckpts.convert_hf_to_neox:cli",
    "deepy-inspect-checkpoint = tools.ckpts.inspect_checkpoint:cli",
    "deepy-plot-metrics = tools.plot_metrics:cli",
    "deepy-gpu-check = tools.gpu_check.cli:cli",
]


setup(
    name="deepy",
    version="0.1.0",
    description="GPT-NeoX-style LLM training with TP/PP/ZeRO that runs and is tested on CPU",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron", "megatron.*", "tools", "tools.*"]),
    install_requires=_requirements("requirements-torch.txt") + _requirements("requirements.txt"),
    extras_require={"dev": _requirements("requirements-dev.txt")},
    entry_points={"console_scripts": CONSOLE_SCRIPTS},
)
