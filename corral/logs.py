"""The server's log lines: text for people, JSON for log pipelines, and the sandbox on every line.

A request for a sandbox sets ``current_sandbox`` (the API's authentication dependency does, for
every route with a sandbox id), so whatever logs while serving it (the service, an edge, a backend)
carries the id without passing it down; a line about another sandbox says so with
``extra={"sandbox_id": ...}``. uvicorn's own loggers go through the same handler.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Literal

__all__ = ["configure_logging", "current_sandbox"]

current_sandbox: contextvars.ContextVar[str | None] = contextvars.ContextVar("corral_sandbox", default=None)

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(sandbox_tag)s: %(message)s"


class _SandboxField(logging.Filter):
    """Every record gets ``sandbox_id`` (its own extra, else the request's) and, for text, a tag."""

    def __init__(self, edge_id: str) -> None:
        super().__init__()
        self._edge_id = edge_id

    def filter(self, record: logging.LogRecord) -> bool:
        sandbox_id = getattr(record, "sandbox_id", None)
        if sandbox_id is None:
            sandbox_id = record.sandbox_id = current_sandbox.get()
        record.edge_id = self._edge_id
        record.sandbox_tag = f" [{sandbox_id}]" if sandbox_id else ""
        return True


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "sandbox_id": getattr(record, "sandbox_id", None),
            "edge_id": getattr(record, "edge_id", None),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(log_format: Literal["text", "json"], level: str, edge_id: str) -> None:
    """One handler on the root logger, to stderr; uvicorn's loggers propagate to it."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_SandboxField(edge_id))
    handler.setFormatter(_JsonFormatter() if log_format == "json" else logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
