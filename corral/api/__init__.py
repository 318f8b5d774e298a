"""The wire contract: the request and response models and the error classes, shared by the server and the SDK.

Both sides import from here (never the other's internals), so the HTTP API is defined once: the gateway
validates requests into these models and raises these errors, the SDK parses responses into the same models
and maps each error body back to its class (docs/architecture.md, "Packages").
"""

from corral.api.errors import *  # noqa: F401,F403
from corral.api.errors import __all__ as _error_names
from corral.api.models import *  # noqa: F401,F403
from corral.api.models import __all__ as _model_names

__all__ = [*_error_names, *_model_names]
