"""Guard: containing and exposing agent misbehaviour (audit events and detectors)."""

from corral.guard.audit import AuditLog, detect_in_command, is_protected

__all__ = ["AuditLog", "detect_in_command", "is_protected"]
