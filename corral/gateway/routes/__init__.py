"""The HTTP API's routes, one module per resource; each declares an ``APIRouter`` that create_app includes.

``deps`` holds what they share (authentication, the services as dependencies, upload limits, NDJSON). A route
parses into a model of corral.api and hands it to a service: a mutation of a sandbox's contents goes through
``Trajectories`` (gateway/trajectory.py), which logs, replays and audits it; the rest through SandboxService,
ImageService or FnCallService. docs/architecture.md, "How to add a route".
"""
