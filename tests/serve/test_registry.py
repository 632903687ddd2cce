"""Replica records and the one staleness rule (no cluster: pure functions on records)."""

import json

from ddserve.serve.registry import (
    ReplicaRecord,
    ReplicaState,
    as_record,
    effective_state,
    forgotten,
    stale_after,
)

NOW = 1_000_000.0


def rec(state, age_s=0.0, **kw) -> ReplicaRecord:
    return ReplicaRecord(replica="r1", state=ReplicaState(state), updated=NOW - age_s, **kw)


def test_record_round_trips_through_json_with_readable_states():
    r = rec("RUNNING", fingerprint="abc", params={"budget": 4}, actor="SERVE_REPLICA::a#b#r1")
    text = json.dumps(r.to_dict())
    assert '"state": "RUNNING"' in text
    back = ReplicaRecord.from_dict(json.loads(text))
    assert back == r and back.state is ReplicaState.RUNNING
    # a newer replica's extra field and an older one's missing fields both read
    assert ReplicaRecord.from_dict({**json.loads(text), "new_field": 1}) == r
    assert as_record({"replica": "http://e", "state": "UNREACHABLE", "fingerprint": ""}).state == (
        ReplicaState.UNREACHABLE
    )


def test_a_running_record_goes_stale_after_three_missed_health_checks():
    period = 10
    assert stale_after(period) == 35
    fresh, old = rec("RUNNING", age_s=30), rec("RUNNING", age_s=36)
    assert effective_state(fresh, health_period_s=period, alive=None, now=NOW) == "RUNNING"
    assert effective_state(old, health_period_s=period, alive=None, now=NOW) == "STALE"
    assert effective_state(old, health_period_s=period, alive=True, now=NOW) == "STALE"
    # a start that takes long (weights loading) is not stale while its actor lives
    assert effective_state(
        rec("STARTING", age_s=600), health_period_s=period, alive=True, now=NOW
    ) == ("STARTING")


def test_a_replica_whose_actor_is_gone_is_dead_at_once_whatever_its_record_says():
    for state in ("RUNNING", "STARTING", "UNHEALTHY"):
        r = rec(state, age_s=0.5)
        assert effective_state(r, health_period_s=10, alive=False, now=NOW) == "DEAD"
    # an ended record keeps its own state (and its reason)
    failed = rec("FAILED", age_s=1, error="engine start: not found")
    assert effective_state(failed, health_period_s=10, alive=False, now=NOW) == "FAILED"


def test_ended_records_are_forgotten_after_a_while_failed_ones_later():
    period = 2  # stale after 11 s, forgotten after 22 s
    assert not forgotten(rec("DEAD", age_s=20), health_period_s=period, now=NOW)
    assert forgotten(rec("DEAD", age_s=23), health_period_s=period, now=NOW)
    assert forgotten(rec("STALE", age_s=23), health_period_s=period, now=NOW)
    assert not forgotten(rec("FAILED", age_s=600), health_period_s=period, now=NOW)
    assert forgotten(rec("FAILED", age_s=4000), health_period_s=period, now=NOW)
    assert not forgotten(rec("RUNNING", age_s=0), health_period_s=period, now=NOW)
