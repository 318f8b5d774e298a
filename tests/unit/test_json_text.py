"""The database's JSON text (corral.state.json_text): the same values back, whatever the strings hold, and the
state store's engine writes it for every JSON column."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from corral.state import json_text
from corral.state.db import StateStore
from corral.trajectory import TrajectoryLog

VALUES: list[Any] = [
    None,
    {"stdout": "x" * 70_000, "stderr": "", "exit_code": 0, "timed_out": False},
    {"text": 'é✓ 中文 \x00\x1f\u2028 "quoted" \\ back', "n": [1, -2.5, 10**30, True, None]},
    {"nested": {"deeper": [{"a": []}, {}]}},
    [0.1, 1e300, -0.0],
]


@pytest.mark.parametrize("value", VALUES)
def test_json_text_loads_back_to_the_same_value(value: Any) -> None:  # noqa: ANN401
    assert json.loads(json_text.dumps(value)) == value


def test_a_lone_surrogate_is_escaped_as_the_standard_library_does() -> None:
    value = {"cmd": "echo \udc80", "env": {}}
    assert json_text.dumps(value) == json.dumps(value)
    assert json.loads(json_text.dumps(value)) == value


def test_the_state_stores_json_columns_hold_that_text(tmp_path: Path) -> None:
    """A step's result as the log stores it through the state store's engine: the compact UTF-8 form, not the
    standard library's (``", "``, ``\\u00e9``), and it reads back as it was given."""
    store = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    log = TrajectoryLog(store.engine)
    result = {"exit_code": 0, "stdout": "é" * 10, "stderr": ""}
    step = log.append("sb-1", "s1", "exec", {"cmd": "true"}, result)
    with store.engine.connect() as conn:
        stored = conn.execute(text("SELECT result FROM trajectory_steps WHERE step_id = 's1'")).scalar_one()
    assert stored == '{"exit_code":0,"stdout":"' + "é" * 10 + '","stderr":""}'
    assert log.steps("sb-1")[0].result == step.result == result
    surrogate = {"cmd": "printf '\udc80'"}  # a JSON body may carry one; the request column falls back for it
    log.append("sb-1", "s2", "exec", surrogate, result)
    assert log.steps("sb-1", after_seq=1)[0].request == surrogate
    store.engine.dispose()
