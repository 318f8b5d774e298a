"""Corral: sandboxes for agentic RL training and evaluation.

``import corral`` gives the SDK (clients, handles, models, errors); the server
components live in their own subpackages and are imported only by the server.
"""

from corral.sdk import *  # noqa: F401,F403
from corral.sdk import __all__  # noqa: F401
