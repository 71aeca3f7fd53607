"""Deepy: a GPT-NeoX-style trainer for large language models (tensor, pipeline and ZeRO parallelism)."""

from pathlib import Path

from setuptools import find_packages, setup


def _requirements(name: str) -> list[str]:
    lines = (Path(__file__).parent / "requirements" / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


setup(
    name="deepy",
    version="0.1.0",
    description="GPT-NeoX-style LLM training with TP/PP/ZeRO that runs and is tested on CPU",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron", "megatron.*"]),
    install_requires=_requirements("requirements-torch.txt") + _requirements("requirements.txt"),
    extras_require={"dev": _requirements("requirements-dev.txt")},
)
