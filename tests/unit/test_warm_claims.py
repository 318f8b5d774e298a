"""A warm-pool sandbox's record changes hands once (StateStore.claim_many), whoever asks and however often."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from corral.gateway.service import WARM_LABEL
from corral.state.db import StateStore
from corral.state.events import EventFilter, EventLog
from corral.testing.records import sandbox_record

_WARM = sandbox_record("sb-e0-00000000000000a1", labels={WARM_LABEL: "0123456789abcdef"}, created_at=1.0)


def _claim(job: str) -> dict[str, object]:
    return {"labels": {"job": job}, "env": {"TASK": job}, "created_at": 2.0, "expires_at": 62.0}


def test_a_warm_record_is_claimed_once_and_takes_the_clients_values(tmp_path: Path) -> None:
    store = StateStore(f"sqlite:///{tmp_path / 'corral.db'}")
    store.insert(_WARM)
    paused = dataclasses.replace(_WARM, id="sb-e0-00000000000000a2", state="paused")
    store.insert(paused)
    claims = {_WARM.id: _claim("j1"), paused.id: _claim("j1")}
    assert store.claim_many(claims, pool_label=WARM_LABEL) == {_WARM.id}  # a paused one is not handed out
    assert store.claim_many({_WARM.id: _claim("j2")}, pool_label=WARM_LABEL) == set()  # nor one claimed already
    record = store.get(_WARM.id)
    assert record is not None
    assert (record.labels, record.env, record.expires_at) == ({"job": "j1"}, {"TASK": "j1"}, 62.0)
    assert [r.id for r in store.list(labels={"job": "j1"})] == [_WARM.id]  # the job column follows
    running = EventLog(store.engine).read(0, EventFilter(job="j1", kinds=["sandbox.running"]))
    assert [e["sandbox_id"] for e in running] == [_WARM.id]  # a job's event stream sees its sandbox start
