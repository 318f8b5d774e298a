"""The Corral SDK: clients, sandbox handles, models and errors.

``Client``/``Sandbox`` are synchronous, ``AsyncClient``/``AsyncSandbox`` the
same API awaited. Installing the SDK alone needs only httpx and pydantic.
"""

from corral.sdk._async_client import AsyncClient, AsyncFiles, AsyncImages, AsyncSandbox
from corral.sdk._exceptions import *  # noqa: F401,F403
from corral.sdk._exceptions import __all__ as _exception_names
from corral.sdk._models import *  # noqa: F401,F403
from corral.sdk._models import __all__ as _model_names
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
    *_exception_names,
    *_model_names,
]
