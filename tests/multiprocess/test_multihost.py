"""job.multihost across 4 real processes x 2 CPU devices, checked on every rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launching import explain, launcher_argv, run, scenario

pytestmark = pytest.mark.multiprocess
RANKS = range(4)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("multihost")
    proc = run(launcher_argv(4, scenario("multihost_all.py")), SCENARIO_OUT=str(out))
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    for rank in RANKS:
        assert f"[rank {rank}] scenario done on rank {rank}" in proc.stdout, proc.stdout
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in RANKS}


def test_every_rank_joined_the_local_cluster(ranks: dict[int, dict]) -> None:
    for rank, seen in ranks.items():
        assert seen["info"] == ["local", rank, 4]
        assert seen["process_count"] == 4
        assert seen["local_device_count"] == 2


def test_device_mesh_is_cached_1d_over_all_devices(ranks: dict[int, dict]) -> None:
    for seen in ranks.values():
        assert seen["mesh_cached"] is True
        assert seen["mesh_axes"] == ["devices"]
        assert seen["mesh_size"] == 8


def test_replicated_and_dp_shardings(ranks: dict[int, dict]) -> None:
    for seen in ranks.values():
        assert seen["replicated_spec"] == "P()"
        assert seen["replicated_full"] is True
        assert seen["dp_spec"] == "P('devices',)"


def test_dp_sharding_assembles_global_batch_from_per_process_data(ranks: dict[int, dict]) -> None:
    expected_rows = [r * 10 + i for r in RANKS for i in range(4)]
    for rank, seen in ranks.items():
        assert seen["batch_shape"] == [16, 3]
        # each process's two devices hold exactly its own rows, one pair per device
        assert seen["batch_local_shards"] == [rank * 10, rank * 10 + 2]
        assert seen["batch_gathered"] == expected_rows
        assert seen["batch_sum"] == 3 * sum(expected_rows)
        assert seen["params_sum_times_batch"] == 15 * 3 * sum(expected_rows)


def test_sync_string_long_unicode_and_edge_cases(ranks: dict[int, dict]) -> None:
    for seen in ranks.values():
        assert seen["sync_long_ok"] is True
        assert seen["sync_other_value_ignored"] == "zero"
        assert seen["sync_empty"] == ""
        assert "expected a string on process 0, found None" in seen["sync_none_error"]


def test_only_specific_processes(ranks: dict[int, dict]) -> None:
    for rank, seen in ranks.items():
        assert seen["only_default"] == ("ran on 0" if rank == 0 else None)
        assert seen["only_list"] == (rank * 2 if rank in (1, 3) else None)
        assert seen["only_int"] == ("two" if rank == 2 else None)


def test_matching_pytrees_pass_on_every_rank(ranks: dict[int, dict]) -> None:
    for seen in ranks.values():
        assert seen["match_same"] is None
        assert seen["match_replicated_global"] is None


def test_value_difference_on_rank_2_is_named_everywhere(ranks: dict[int, dict]) -> None:
    for rank, seen in ranks.items():
        message = seen["match_value_diff"]
        if rank == 2:
            assert "between process 2 and process 0" in message
            assert "'params/w' (values differ)" in message
            assert "params/b" not in message
        else:
            assert "process(es) [2] differ from process 0" in message


def test_structure_differences_name_their_paths(ranks: dict[int, dict]) -> None:
    for rank, seen in ranks.items():
        message = seen["match_structure_diff"]
        if rank == 1:
            assert "'params/w' (shape (2, 4) vs (2, 3))" in message
        elif rank == 3:
            assert "'only_on_3' (only in this process's tree)" in message
        else:
            assert "process(es) [1, 3] differ from process 0" in message


def test_local_assert_pytrees_match(ranks: dict[int, dict]) -> None:
    for seen in ranks.values():
        assert "'a' (values differ)" in seen["local_match_error"]


def test_single_host_jax_and_orbax_inside_a_4_process_run(ranks: dict[int, dict]) -> None:
    for rank, seen in ranks.items():
        assert seen["inside"] == {
            "process_index": 0,
            "process_count": 1,
            "devices_are_local": True,
            "orbax_skips_sync": True,
        }
        assert seen["inside_ckpt_roundtrip"] == [rank, rank + 1, rank + 2, rank + 3]
        assert seen["after"] == {"process_index": rank, "process_count": 4, "devices_are_local": False}


def test_hosts_saving_on_their_own_at_once_never_wait_on_each_other(tmp_path: Path) -> None:
    # Orbax signals an async save's stages through a key-value store; shared between the hosts,
    # one host's save read or deleted another's signals and that save never ended (within a few rounds)
    rounds = 25
    proc = run(launcher_argv(4, scenario("single_host_saves.py", str(rounds)), devices=1), timeout=120,
               SCENARIO_OUT=str(tmp_path))
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    for rank in RANKS:
        restored = json.loads((tmp_path / f"saves{rank}.json").read_text())
        assert restored == [[100 * rank + i + k for k in range(3)] for i in range(rounds)]


def test_a_barrier_that_times_out_names_the_missing_process(ranks: dict[int, dict]) -> None:
    for rank, seen in ranks.items():
        if rank == 1:
            assert seen["barrier_timeout"] is None
        else:
            assert seen["barrier_timeout"] == (
                f"barrier 'lonely': expected all 4 processes within 1.5 s, found process(es) 1 missing "
                f"(this is process {rank}). Fix: read those processes' logs: they died, hung, or took another path"
            )
