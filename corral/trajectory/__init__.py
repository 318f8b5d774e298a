"""Trajectory: the per-sandbox, totally ordered, durable log of steps and results; replay and provenance."""

from corral.trajectory.log import (
    DEFAULT_LOG_OUTPUT_CAP_BYTES,
    LOG_CAP_KEY,
    Replay,
    Step,
    StepState,
    TrajectoryLog,
    request_digest,
    trajectory_metadata,
    trajectory_steps,
)

__all__ = [
    "DEFAULT_LOG_OUTPUT_CAP_BYTES",
    "LOG_CAP_KEY",
    "Replay",
    "Step",
    "StepState",
    "TrajectoryLog",
    "request_digest",
    "trajectory_metadata",
    "trajectory_steps",
]
