"""Adapters that let evaluation and agent frameworks run on Corral sandboxes with a config change.

Each module imports its framework, so it is imported only by that framework (Inspect loads
``corral.integrations.inspect`` through its ``inspect_ai`` entry point, Harbor ``corral.integrations.harbor``
from its ``--env module:Class``) or by the user's own code (``corral.integrations.mini_swe_agent``). Install
the matching extra: ``corral[inspect]``, ``corral[mini-swe-agent]``; Harbor needs Python 3.12+, so Corral goes
into Harbor's environment instead. docs/integrations.md shows what a user writes for each.
"""
