"""Where the SDK finds the server: argument > environment > config file.

``corral serve`` writes the config file (``$CORRAL_CONFIG_FILE``, default
``~/.config/corral/client.json``) with its URL and API key, so scripts and the
CLI on the same machine need no setup; ``CORRAL_URL`` and ``CORRAL_API_KEY``
override it, and explicit arguments override both.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from corral.api.errors import AuthenticationError

__all__ = ["default_config_path", "resolve_connection"]

DEFAULT_URL = "http://127.0.0.1:7070"


def default_config_path() -> Path:
    return Path(os.environ.get("CORRAL_CONFIG_FILE") or Path.home() / ".config" / "corral" / "client.json")


def resolve_connection(url: str | None, api_key: str | None) -> tuple[str, str]:
    stored: dict[str, str] = {}
    path = default_config_path()
    if (url is None or api_key is None) and path.exists():
        stored = json.loads(path.read_text())
    url = url or os.environ.get("CORRAL_URL") or stored.get("url") or DEFAULT_URL
    api_key = api_key or os.environ.get("CORRAL_API_KEY") or stored.get("api_key")
    if not api_key:
        raise AuthenticationError(
            f"no API key: pass api_key=, set CORRAL_API_KEY, or start `corral serve`, which writes {path}"
        )
    return url.rstrip("/"), api_key
