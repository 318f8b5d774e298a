"""Which logged steps a sandbox still carries after checkpoint restores (what replay re-runs)."""

from __future__ import annotations

from corral.gateway.trajectory import _effective_steps
from corral.trajectory import Step


def _step(seq: int, kind: str, name: str) -> Step:
    request = {"checkpoint": name} if kind == "restore" else {"cmd": name}
    result = {"checkpoint": name} if kind == "checkpoint" else {"exit_code": 0}
    return Step("sb", seq, f"s{seq}", kind, request, "", "done", result, False, 0.0, 0.0, None)


def _names(steps: list[Step]) -> list[str]:
    return [s.request["cmd"] for s in steps]


def test_a_restore_drops_what_came_after_its_checkpoint() -> None:
    log = [_step(1, "exec", "a"), _step(2, "checkpoint", "A"), _step(3, "exec", "b"), _step(4, "restore", "A"),
           _step(5, "exec", "c")]  # fmt: skip
    assert _names(_effective_steps(log)) == ["a", "c"]


def test_restores_back_and_forth_give_each_checkpoints_own_history() -> None:
    # s1, checkpoint A, s2, checkpoint B, restore A, s3, restore B: the sandbox holds s1 and s2 again.
    log = [_step(1, "exec", "s1"), _step(2, "checkpoint", "A"), _step(3, "exec", "s2"), _step(4, "checkpoint", "B"),
           _step(5, "restore", "A"), _step(6, "exec", "s3"), _step(7, "restore", "B")]  # fmt: skip
    assert _names(_effective_steps(log)) == ["s1", "s2"]
