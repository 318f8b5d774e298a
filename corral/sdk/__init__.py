"""The Corral SDK: clients, sandbox handles, models and errors.

``Client``/``Sandbox`` are synchronous, ``AsyncClient``/``AsyncSandbox`` the
same API awaited. Models and errors are corral.api's (the wire contract the server
shares). Installing the SDK alone needs only httptools, httpx (its TLS defaults) and pydantic.
"""

from corral.api.errors import *  # noqa: F401,F403
from corral.api.errors import __all__ as _error_names
from corral.api.models import *  # noqa: F401,F403
from corral.api.models import __all__ as _model_names
from corral.sdk._async_client import AsyncClient, AsyncFiles, AsyncImages, AsyncSandbox
from corral.sdk._sync_client import Client, Files, Images, Sandbox

__all__ = [
    "AsyncClient",
    "AsyncFiles",
    "AsyncImages",
    "AsyncSandbox",
    "Client",
    "Files",
    "Images",
    "Sandbox",
    *_error_names,
    *_model_names,
]
