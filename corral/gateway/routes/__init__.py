"""The HTTP API's routes, one module per resource; each declares an ``APIRouter`` that create_app includes.

``deps`` holds what they share (authentication, the services as dependencies, upload limits, NDJSON). A route
parses into a model of corral.api and hands it to a service: every change to an existing sandbox (a command,
a file, its life) goes through ``Operations`` (gateway/operations.py), which logs it in the sandbox's
trajectory, answers a resent ``step_id`` from the log and audits it; creates, reads and the rest through
SandboxService, ImageService, Trajectories or FnCallService. docs/architecture.md, "How to add a route".
"""
