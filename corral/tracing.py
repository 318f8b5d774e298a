"""OpenTelemetry trace export of sandbox create and exec, or nothing at all.

Off by default (``CORRAL_OTEL_TRACES``). Off, ``span()`` hands back one shared object whose enter, exit and
``set`` do nothing, and opentelemetry is never imported (tests/unit/test_package_layers.py checks): the create
and exec paths pay a function call and a with-statement. On (``pip install 'corral[otel]'``), the SDK batches
spans on a thread of its own and posts them over OTLP/HTTP to the collector the standard variables name
(``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``OTEL_SERVICE_NAME``,
``OTEL_BSP_SCHEDULE_DELAY``, ...), so a deployment's usual OTel settings apply unchanged.

A span nests under the one open in the same asyncio task (a context variable), which is how an embedded
server's edge and agent spans become children of the gateway's request span. Span attributes are prefixed
``corral.``: ``sandbox_id``, ``backend``, ``edge_id`` and ``outcome`` (``ok``, the error code of the
CorralError that ended it, or the exception's type).
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any

__all__ = ["SERVICE_NAME", "Span", "configure", "enabled", "shutdown", "span"]

SERVICE_NAME = "corral"
"""The service name when OTEL_SERVICE_NAME is not set."""
_PREFIX = "corral."

_tracer: Any = None  # an opentelemetry Tracer while export is on
_provider: Any = None


class Span:
    """A span being recorded, as a context manager; the shared instance ``_OFF`` records nothing."""

    __slots__ = ("_manager", "_span")

    def __init__(self, manager: Any = None) -> None:  # noqa: ANN401 - opentelemetry's context manager
        self._manager = manager
        self._span: Any = None

    def __enter__(self) -> Span:
        if self._manager is not None:
            self._span = self._manager.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._manager is None:
            return
        if self._span.is_recording() and _PREFIX + "outcome" not in (self._span.attributes or {}):
            self.set("outcome", "ok" if exc is None else str(getattr(exc, "code", None) or type(exc).__name__))
        self._manager.__exit__(kind, exc, traceback)

    def set(self, key: str, value: str | int | float | bool) -> None:
        """Set attribute ``corral.<key>``."""
        if self._span is not None:
            self._span.set_attribute(_PREFIX + key, value)


_OFF = Span()


def span(name: str, **attributes: str | int | float | bool | None) -> Span:
    """A child of the current span (or a new trace), with ``corral.``-prefixed attributes (None ones left out)."""
    if _tracer is None:
        return _OFF
    given = {_PREFIX + key: value for key, value in attributes.items() if value is not None}
    return Span(_tracer.start_as_current_span(name, attributes=given))


def enabled() -> bool:
    return _tracer is not None


def configure(on: bool) -> None:
    """Turn export on for this process (``CORRAL_OTEL_TRACES``); off, nothing is imported."""
    global _tracer, _provider
    if not on or _tracer is not None:
        return
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError(
            f"CORRAL_OTEL_TRACES is on but OpenTelemetry is not installed ({exc}): pip install 'corral[otel]'"
        ) from None
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or SERVICE_NAME})
    _provider = TracerProvider(resource=resource)
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    _tracer = _provider.get_tracer("corral")


def shutdown() -> None:
    """Send what is still batched and stop exporting."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None
