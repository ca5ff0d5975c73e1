"""The data-parallel router (engine/entrypoints/dp_router.py) and the front end's pure parts:
load, grammar affinity, busy fallback, dead replicas, configuration errors. No Ray."""

from __future__ import annotations

import pytest

from baton.engine.entrypoints.data_parallel import grammar_key, merge_stats, request_cost
from baton.engine.entrypoints.dp_config import DataParallelConfig
from baton.engine.entrypoints.dp_router import NoReplicaError, ReplicaRouter
from baton.engine.sampling_params import SamplingParams
from baton.grammar.spec import StructuredOutputsParams


def test_plain_requests_go_to_the_least_loaded_replica() -> None:
    r = ReplicaRouter(3)
    assert [r.route(None, 10).replica for _ in range(3)] == [0, 1, 2]
    r.done(1, 10)
    assert r.route(None, 5).replica == 1
    assert r.route(None, 1).replica == 1  # 5 + 1 beats 10
    assert r.route(None, 1).affinity is None
    assert [r.load(i) for i in range(3)] == [10, 7, 10]


def test_a_grammar_sticks_to_its_replica_until_that_replica_is_busy() -> None:
    r = ReplicaRouter(2, balance_tokens=100)
    first = r.route("schema-a", 50)
    assert first.affinity == "new"
    # The other replica is now less loaded, but within the balance: affinity wins.
    again = r.route("schema-a", 50)
    assert (again.replica, again.affinity) == (first.replica, "hit")
    other = 1 - first.replica
    assert r.route("schema-b", 10).replica == other  # new grammar: least loaded
    # first holds 100 tokens against 10: still within 100 of the least loaded.
    assert r.route("schema-a", 20).affinity == "hit"
    # 120 vs 10 is past the balance: the grammar moves, and now belongs to the other one.
    moved = r.route("schema-a", 5)
    assert (moved.replica, moved.affinity) == (other, "miss")
    assert r.route("schema-a", 1).replica == other
    assert r.affinity_counts == {"hit": 3, "miss": 1, "new": 2}
    assert r.routed[first.replica] + r.routed[other] == 6


def test_without_affinity_grammars_are_routed_by_load_alone() -> None:
    r = ReplicaRouter(2, affinity=False)
    assert [r.route("schema", 10).replica for _ in range(4)] == [0, 1, 0, 1]
    assert r.affinity_counts == {"hit": 0, "miss": 0, "new": 0}


def test_a_dead_replica_gets_nothing_and_forgets_its_grammars() -> None:
    r = ReplicaRouter(2, balance_tokens=10**6)
    owner = r.route("g", 1).replica
    r.set_healthy(owner, False)
    assert not r.healthy(owner)
    moved = r.route("g", 1)
    assert moved.replica == 1 - owner and moved.affinity == "new"
    r.set_healthy(owner, True)
    # Back up, but the grammar now lives on the survivor.
    assert r.route("g", 1).replica == 1 - owner
    r.set_healthy(0, False)
    r.set_healthy(1, False)
    with pytest.raises(NoReplicaError):
        r.route(None, 1)


def test_router_and_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="data parallel size"):
        ReplicaRouter(0)
    with pytest.raises(ValueError, match="balance_tokens"):
        ReplicaRouter(2, balance_tokens=-1)
    with pytest.raises(ValueError, match="data_parallel_size"):
        DataParallelConfig(size=0)
    with pytest.raises(ValueError, match="backend"):
        DataParallelConfig(size=2, backend="mp")
    with pytest.raises(ValueError, match="cpus_per_replica"):
        DataParallelConfig(size=2, cpus_per_replica=0)
    with pytest.raises(ValueError, match="max_restarts"):
        DataParallelConfig(size=2, max_restarts=-2)


def test_grammar_key_and_cost() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    a = SamplingParams(max_tokens=10, structured_outputs=StructuredOutputsParams(json=schema))
    b = SamplingParams(max_tokens=99, structured_outputs=StructuredOutputsParams(json=dict(schema)))
    c = SamplingParams(
        max_tokens=10, structured_outputs=StructuredOutputsParams(json=schema, whitespace="any")
    )
    assert grammar_key(a) == grammar_key(b) != grammar_key(c)
    assert grammar_key(SamplingParams()) is None
    assert request_cost([1, 2, 3], SamplingParams(max_tokens=10, n=2)) == 23
    assert request_cost("x" * 40, SamplingParams(max_tokens=5)) == 16


def test_serve_options_build_the_data_parallel_config() -> None:
    import argparse

    from baton.engine.server.serve import add_serve_parser, data_parallel_config

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    assert data_parallel_config(parser.parse_args(["serve"])) is None
    dp = data_parallel_config(
        parser.parse_args(["serve", "-dp", "2", "--ray-address", "auto", "--no-grammar-affinity"])
    )
    assert dp == DataParallelConfig(size=2, ray_address="auto", grammar_affinity=False)
    with pytest.raises(ValueError, match="--ray-address needs --data-parallel-size > 1"):
        data_parallel_config(parser.parse_args(["serve", "--ray-address", "auto"]))
    with pytest.raises(ValueError, match="data_parallel_size"):
        data_parallel_config(parser.parse_args(["serve", "-dp", "0"]))


def test_replica_stats_merge_like_one_engine() -> None:
    same = {"tensor_parallel_size": 2, "dtype": "bfloat16", "quantization": "int8"}
    a = {"steps": 10, "kv_usage": 0.5, **same, "pid": 1}
    b = {"steps": 5, "kv_usage": 0.1, **same, "pid": 2}
    merged = merge_stats([a, b])
    assert merged["steps"] == 15
    assert merged["kv_usage"] == pytest.approx(0.3)
    assert merged["tensor_parallel_size"] == 2 and merged["dtype"] == "bfloat16"
    assert merged["quantization"] == "int8"
    assert "pid" not in merged
    assert merge_stats([]) == {}
