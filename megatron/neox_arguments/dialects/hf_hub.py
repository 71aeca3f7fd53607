"""Hugging Face hub names in dialect configs, found in this machine's hub cache; nothing is downloaded.

Levanter's configs name models and tokenizers on the hub (``initialize_from_hf: meta-llama/Llama-3.1-8B``,
``model_name_or_path``, ``tokenizer``, each model type's ``reference_checkpoint``), with an optional revision after
``@`` (``RepoRef.from_string``, compat/hf_checkpoints.py:93-109@9263f81e); Levanter fetches them when it starts
(transformers' ``from_pretrained``). Deepy reads a config before launch and downloads nothing: a name is looked up
in the hub cache that ``hf download <name>`` (huggingface_hub) fills - ``HF_HUB_CACHE``, else
``HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
``~/.cache/huggingface/hub`` (huggingface_hub/constants.py:159-181, huggingface_hub 2.4.0), read when the config is
read - and becomes the snapshot directory of that revision (``refs/<revision>`` or a commit hash). A name not
cached is refused by name, with the command that fetches it.
"""

from __future__ import annotations

import os
import re

from megatron.neox_arguments.dialects.common import Refused

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
"""huggingface_hub's repo id: ``name`` or ``namespace/name`` (its validate_repo_id's characters)."""


def hub_cache_dir() -> str:
    """The hub cache huggingface_hub would use now (huggingface_hub/constants.py:159-181, 2.4.0)."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    default = os.environ.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return os.path.expanduser(os.path.expandvars(os.environ.get("HF_HUB_CACHE") or default))


def split_ref(text: str) -> tuple[str, str | None]:
    """``name@revision`` -> (name, revision), as Levanter's RepoRef.from_string reads it (hf_checkpoints.py:105-109)."""
    name, sep, revision = text.partition("@")
    return name, (revision if sep else None)


def is_hub_name(text: str) -> bool:
    """A hub repo id (with an optional ``@revision``), not a local path that exists or a ``scheme://`` URL."""
    if "://" in text or os.path.exists(text) or text.startswith((".", "/", "~")):
        return False
    return bool(_REPO_ID.match(split_ref(text)[0]))


def cached_file(text: str, filename: str) -> str | None:
    """``filename`` of hub repo ``text`` (``name[@revision]``) in the hub cache, or None where it is not there."""
    # lazy: huggingface_hub, only for configs that name the hub
    from huggingface_hub import try_to_load_from_cache

    name, revision = split_ref(text)
    found = try_to_load_from_cache(name, filename, cache_dir=hub_cache_dir(), revision=revision)
    return found if isinstance(found, str) and os.path.isfile(found) else None


def local_dir(value: str, filename: str, what: str) -> str:
    """The local directory ``value`` stands for: itself where it holds ``filename``, else the cached snapshot of hub
    repo ``value`` that holds it; refused otherwise (``what`` names the thing for the message)."""
    if os.path.isfile(os.path.join(value, filename)):
        return value
    if is_hub_name(value):
        found = cached_file(value, filename)
        if found is not None:
            return os.path.dirname(found)
        raise Refused(f"{value!r} is a Hugging Face hub name whose {filename} is not in this machine's hub cache "
                      f"({hub_cache_dir()}); Deepy downloads nothing: fetch it first (hf download {split_ref(value)[0]}"
                      f"{' --revision ' + str(split_ref(value)[1]) if split_ref(value)[1] else ''}), or give the "
                      f"local {what}")
    if "://" in value:
        raise Refused(f"{value!r} is a URL; Deepy reads the {what} on this machine and downloads nothing: copy it here "
                      f"and give its local path")
    raise Refused(f"{value!r} is not a local {what} (no {filename} there) nor a Hugging Face hub name")


__all__ = ["cached_file", "hub_cache_dir", "is_hub_name", "local_dir", "split_ref"]
