"""Ray on several nodes (issue 15): client states on their nodes, node loss, joining a cluster.

The cases run in subprocesses (``tests/cluster_cases.py``; a driver joins one Ray instance and this
session already runs one), each mode once per module, on local multi-node clusters (loopback only,
free ports, Ray's files in a private temporary folder):

* ``cluster``: head + 3 nodes (``ray.cluster_utils.Cluster``), 3 workers, one per node. Inline
  equals Ray (weights within 1e-6, same result rows) for FedAvg and for SCAFFOLD with node-local
  disk homes; a home whose node-local files vanish names the missing client and round; a node
  removed mid-run stops a run without checkpoint naming the node and workers, and a checkpointed
  run recovers (rolled back once, result equal to the uninterrupted run); FedAvg reruns the lost
  worker's clients elsewhere; no process touched a path outside its own node's folder.
* ``join``: a head started by ``ray start``, two worker nodes; the driver joins with
  ``engine.address`` and its workers import the shipped checkout (``engine.runtime_env=auto``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import REPO, short_tmp

CLUSTER_CASES = ["cluster_up", "fedavg_inline_equals_ray_3_nodes", "scaffold_node_local_disk_equals_inline",
                 "missing_state_names_the_client", "node_lost_without_checkpoint_fails_naming_it",
                 "node_lost_recovers_from_checkpoint", "fedavg_node_lost_reruns_elsewhere",
                 "lent_states_lost_with_their_node_stop_the_round",
                 "nodes_touch_only_their_own_folders"]
JOIN_CASES = ["cluster_up", "join_with_engine_address_ships_the_code"]


def run_cases(mode: str, timeout: float) -> tuple[dict[str, dict], str]:
    """Run one mode of cluster_cases.py; returns its cases by name and the tail of its stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    with short_tmp("flc") as tmp:
        env.update(RAY_TMPDIR=tmp, TMPDIR=tmp, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, str(REPO / "tests" / "cluster_cases.py"), mode, tmp], cwd=tmp,
                              env=env, capture_output=True, text=True, timeout=timeout)
    cases = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            cases[entry["case"]] = entry
    return cases, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def cluster_results():
    return run_cases("cluster", timeout=900)


@pytest.fixture(scope="module")
def join_results():
    return run_cases("join", timeout=600)


def check(results: tuple[dict[str, dict], str], name: str) -> None:
    cases, stderr = results
    assert name in cases, f"case {name} did not report; stderr:\n{stderr}"
    assert cases[name]["ok"], json.dumps(cases[name]["detail"], indent=1)[-4000:]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.xdist_group("cluster_nodes")  # one pytest worker runs the cluster mode once; the join mode may run
@pytest.mark.parametrize("name", CLUSTER_CASES)  # on the other at the same time
def test_three_node_cluster(cluster_results, name):
    check(cluster_results, name)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.xdist_group("cluster_join")
@pytest.mark.parametrize("name", JOIN_CASES)
def test_join_a_cluster_with_engine_address(join_results, name):
    check(join_results, name)
