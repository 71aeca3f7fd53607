"""What ``soft_prompt_tuning`` asks for, read without torch (the checks before launch read it too); the prompt
itself is ``soft_prompt.py``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SOFT_PROMPT_KEYS: dict[str, Any] = {"enabled": False, "n_tokens": 10, "init_string": "", "init_range": 0.5}
"""The entries GPT-NeoX's code reads from ``soft_prompt_tuning`` and their defaults there."""
PROMPT_NAME = "soft_prompt"
"""The ``GPTModel`` attribute (and parameter-name prefix) of the prompt."""


@dataclass(frozen=True)
class SoftPromptSettings:
    n_tokens: int
    init_string: str
    init_range: float

    @staticmethod
    def of(value: Mapping[str, Any] | None) -> SoftPromptSettings | None:
        """The prompt ``soft_prompt_tuning`` asks for; None unless ``enabled`` (GPT-NeoX's default: off)."""
        if not value or not value.get("enabled", SOFT_PROMPT_KEYS["enabled"]):
            return None
        return SoftPromptSettings(n_tokens=int(value.get("n_tokens", SOFT_PROMPT_KEYS["n_tokens"])),
                                  init_string=str(value.get("init_string", SOFT_PROMPT_KEYS["init_string"])),
                                  init_range=float(value.get("init_range", SOFT_PROMPT_KEYS["init_range"])))
