"""Whether a W&B run started on this machine would find an API key, decided by wandb's own code.

wandb 0.31.0 (pinned in requirements/requirements.txt) logs in inside ``wandb.init`` unless the run's mode is
offline or disabled (``wandb/sdk/wandb_init.py:185-205``, ``maybe_login``). The mode is the one ``wandb.init``
is given (Deepy: the tracker's ``mode``), else ``WANDB_MODE``, else the ``mode`` of wandb's settings files
(``$WANDB_CONFIG_DIR/settings``, by default ``~/.config/wandb/settings``, where ``wandb offline`` writes it;
``wandb/sdk/wandb_setup.py:211-235``). The key comes from ``WANDB_API_KEY`` (or ``WANDB_IDENTITY_TOKEN_FILE``),
else the host's entry of the netrc file (``NETRC``, else ``~/.netrc``: what ``wandb login`` writes), else the
settings' ``api_key`` (``wandb/sdk/lib/wbauth/authenticate.py:171-223``). With none, wandb prompts for one, and a
process without a terminal (every rank: the launcher gives them none) gets ``UsageError: No API key configured.
Use `wandb login` to log in.`` (``authenticate.py:127-143``), after the model and the engine are built.

:func:`login_state` follows ``_use_system_auth``'s order with wandb's own pieces (its settings loading, key
validation and netrc reader), without ``authenticate_session``: that loads wandb's process-wide settings, which a
later ``wandb.init`` in the same process would then read with the environment of this moment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatron.logging.config import WandbMode

LoginState = Literal["no_login_needed", "logged_in", "no_key", "bad_key", "unknown"]


@dataclass(frozen=True)
class WandbLogin:
    state: LoginState
    mode: str
    """The mode wandb would run in (``online``, ``offline``, ``disabled``, ...)."""
    detail: str = ""
    """Why ``unknown`` (a wandb without these functions), or wandb's words for a ``bad_key``."""


def login_state(host: str, mode: WandbMode | None) -> WandbLogin:
    """What ``wandb.init(mode=mode, settings=Settings(base_url=host))`` would find on this machine."""
    try:
        # lazy: wandb is optional and slow to import
        from wandb import env
        from wandb.sdk.lib import wbauth
        from wandb.sdk.wandb_settings import Settings
    except ImportError as err:  # no wandb (the tracker check names it), or another layout than 0.31.0's
        return WandbLogin("unknown", mode or "", f"wandb's login functions are not importable here ({err})")
    settings = Settings()
    settings.quiet = True  # no "Loading settings from ..." line in deepy.py's output
    config_dir = os.environ.get("WANDB_CONFIG_DIR")
    settings.settings_system = str(Path(config_dir).expanduser() / "settings" if config_dir
                                   else Path("~", ".config", "wandb", "settings").expanduser())
    settings.update_from_system_settings()
    settings.update_from_env_vars(dict(os.environ))
    if mode is not None:
        settings.update_from_settings(Settings(mode=mode))
    if settings.mode in ("offline", "dryrun", "disabled"):  # its _offline and _noop (wandb_settings.py:1672-1683)
        return WandbLogin("no_login_needed", settings.mode)
    url = wbauth.HostUrl(host)
    try:  # _try_env_auth, then the netrc file, then the settings' key (authenticate.py:198-208)
        if os.getenv(env.API_KEY):
            wbauth.AuthApiKey(host=url, api_key=os.environ[env.API_KEY])  # refuses a key of the wrong form
            return WandbLogin("logged_in", settings.mode)
        if os.getenv(env.IDENTITY_TOKEN_FILE) or wbauth.read_netrc_auth(host=url):
            return WandbLogin("logged_in", settings.mode)
    except Exception as err:  # noqa: BLE001 - wandb's own refusal of a key (AuthenticationError), said as it is
        return WandbLogin("bad_key", settings.mode, f"{type(err).__name__}: {err}")
    if settings.api_key and url.is_same_url(settings.base_url):
        return WandbLogin("logged_in", settings.mode)
    return WandbLogin("no_key", settings.mode)
