"""Faults: a Ray worker that dies mid-round is restarted and the round's result is unchanged;
a client whose update is non-finite is rejected (skip) or stops the run (fail), never averaged in."""

from __future__ import annotations

import pytest
import torch

from fl_platform.engine.faults import Faults, FaultyWorker
from fl_platform.engine.worker import Worker
from fl_platform.experiment import build
from fl_platform.rounds.engine import StateLost
from fl_platform.rounds.sampling import sample_clients
from fl_platform.rounds.simulation import is_timing_key
from fl_platform.training.loop import NonFiniteError

from .conftest import compose_config

COMMON = ("rounds=3", "train.epochs=1", "clients_per_round=12", "engine.threads_per_worker=1")


def run(*overrides: str):
    exp = build(compose_config(*COMMON, *overrides))
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    return exp


def results(exp) -> list[dict]:
    return [{k: v for k, v in row.items() if not is_timing_key(k)} for row in exp.simulation.history]


@pytest.mark.ray
@pytest.mark.parametrize("overrides", [("algorithm=fedavg",),
                                       ("algorithm=scaffold", "engine.state_store=disk"),
                                       ("algorithm=scaffold", "engine.state_store=distributed")],
                         ids=["fedavg", "scaffold-disk", "scaffold-distributed"])
def test_worker_killed_mid_round_does_not_change_the_result(ray_session, overrides, caplog):
    victim = sample_clients(0, 1, 100, 12)[5]  # a client of round 2 (0-based round 1)
    # Fault-free reference: inline (equal to Ray's fault-free result, see test_engine_determinism).
    clean = run(*overrides)
    with caplog.at_level("WARNING", logger="fl_platform.engine"):
        faulty = run("engine=ray", "engine.num_workers=2", *overrides,
                     f"engine.fault_injection.client={victim}", "engine.fault_injection.round=2")
    assert faulty.engine.restarts == 1
    assert any("died" in r.getMessage() and "rerunning its clients" in r.getMessage() for r in caplog.records)
    assert float((faulty.simulation.server.weights - clean.simulation.server.weights).abs().max()) <= 1e-6
    assert results(faulty) == results(clean)


@pytest.mark.ray
def test_a_worker_that_dies_before_holding_any_state_loses_nothing(ray_session):
    """States in the workers' memory: a worker killed in round 1, before any client has a committed
    state, is replaced and the round rerun (it used to end the run as if states were lost)."""
    victim = sample_clients(0, 0, 100, 12)[5]
    overrides = ("algorithm=scaffold", "engine.state_store=memory")
    clean = run(*overrides)
    faulty = run("engine=ray", "engine.num_workers=2", *overrides, f"engine.fault_injection.client={victim}",
                 "engine.fault_injection.round=1")
    assert faulty.engine.restarts == 1 and faulty.engine.state_backend == "memory"
    assert float((faulty.simulation.server.weights - clean.simulation.server.weights).abs().max()) <= 1e-6
    assert results(faulty) == results(clean)


def round1_client(on_worker: int | None = None) -> int:
    """A client of round 1 (on the given home worker of two, which the scheduler prefers)."""
    clients = sample_clients(0, 0, 100, 12)
    return next(c for c in clients[4:] if on_worker is None or c % 2 == on_worker)


@pytest.mark.ray
def test_a_worker_that_dies_before_applying_its_states_in_memory_stops_the_round(ray_session):
    """Its result arrived, its new states were staged in its memory and died with it before the engine
    asked it to apply them: the round ends with StateLost (a rollback to the last checkpoint, or here,
    with none, the run stops). It used to go on as if they were applied, until a later round missed them."""
    with pytest.raises(StateLost, match=r"held this round's new states, not yet applied.*no checkpoint"):
        run("engine=ray", "engine.num_workers=2", "algorithm=scaffold", "engine.state_store=memory", "rounds=1",
            f"engine.fault_injection.client={round1_client()}", "engine.fault_injection.round=1",
            "engine.fault_injection.at=commit")


@pytest.mark.ray
def test_a_worker_that_dies_before_applying_its_states_on_disk_is_completed(ray_session):
    """The same death with node-local files: the staged states survive on the node, the new actor applies
    them, and the result equals the fault-free one."""
    overrides = ("algorithm=scaffold", "engine.state_store=distributed")
    clean = run(*overrides)
    faulty = run("engine=ray", "engine.num_workers=2", *overrides, f"engine.fault_injection.client={round1_client()}",
                 "engine.fault_injection.round=1", "engine.fault_injection.at=commit")
    assert faulty.engine.restarts == 1
    assert float((faulty.simulation.server.weights - clean.simulation.server.weights).abs().max()) <= 1e-6
    assert results(faulty) == results(clean)


@pytest.mark.ray
def test_a_worker_lost_in_the_reduction_tree_reruns_the_round(ray_session):
    """SCAFFOLD's partial aggregates (2 x 9,610 float64) are reduced among the workers: worker 0 dies
    when asked to add worker 1's, after its own result arrived. The round runs again on both, states in
    memory included (nothing was applied), and equals the fault-free one."""
    overrides = ("algorithm=scaffold", "engine.state_store=memory")
    clean = run(*overrides)
    faulty = run("engine=ray", "engine.num_workers=2", *overrides, f"engine.fault_injection.client={round1_client(0)}",
                 "engine.fault_injection.round=1", "engine.fault_injection.at=merge")
    assert faulty.engine.tree and faulty.engine.restarts == 1
    assert float((faulty.simulation.server.weights - clean.simulation.server.weights).abs().max()) <= 1e-6
    assert results(faulty) == results(clean)


@pytest.mark.ray
def test_a_worker_that_died_after_its_result_reruns_with_the_failed_one(ray_session):
    """Two deaths in one round: worker 1 dies training (fault injection), worker 0 after its result
    arrived (killed here before the engine looks). Its new states were in its memory: both rerun, and
    the result equals the fault-free one (the second used to be left out of the rerun, its states lost).

    Worker 0 must borrow no state from worker 1 in that round: a borrower's call depends on its
    lender's export, which the lender's death can take with it (the export's reply not yet sent when
    the process exits), and then the borrower fails too instead of delivering its result (CI saw this
    with 12 clients, where both workers borrow). With 8 clients, round 1's plan (before any timing is
    measured, so the same in every run) lends only from worker 0 to worker 1."""
    import ray

    from fl_platform.state.distributed import home_worker

    overrides = ("algorithm=scaffold", "engine.state_store=memory", "model.hidden=[8]", "clients_per_round=8")
    victim = 45
    clean = run(*overrides)
    exp = build(compose_config(*COMMON, "engine=ray", "engine.num_workers=2", *overrides,
                               f"engine.fault_injection.client={victim}", "engine.fault_injection.round=1"))
    collect, killed = exp.engine._collect, []

    def collect_then_kill(refs, results_, arrived, t_submit):
        failed = collect(refs, results_, arrived, t_submit)
        if failed and not killed:
            assert failed == {1}
            assert results_[0] is not None and results_[0].states_written
            ray.kill(exp.engine.pool[0], no_restart=True)
            killed.append(0)
        return failed

    try:
        assert exp.cfg.clients_per_round == 8
        plan = exp.engine.scheduler.plan(sample_clients(0, 0, 100, 8)).assignment
        assert victim in plan[1] and all(home_worker(c, 2) == 0 for c in plan[0]), plan
        exp.engine._collect = collect_then_kill
        assert not exp.engine.tree
        exp.simulation.run()
    finally:
        exp.engine.close()
    assert killed and exp.engine.restarts == 2
    assert float((exp.simulation.server.weights - clean.simulation.server.weights).abs().max()) <= 1e-6
    assert results(exp) == results(clean)


@pytest.mark.ray
@pytest.mark.parametrize(("at", "step"), [("hang", "their share of the round's training"),
                                          ("hang_commit", "saving client states after round 2")])
def test_a_hung_worker_is_killed_after_the_round_timeout_and_its_call_made_again(ray_session, caplog, at, step):
    """engine.round_timeout_s bounds every call the engine waits on: a worker that sends no answer in
    time is killed, replaced on its node and the call made again; the result equals the fault-free one
    (the states on disk survive its process). ``hang``: it sleeps at a client of round 2 (its share is
    rerun); ``hang_commit``: when asked to apply round 2's new states, after its result arrived (the new
    actor applies them from its node's files). Without the key the driver would wait for an hour."""
    victim = sample_clients(0, 1, 100, 12)[5]
    overrides = ("algorithm=scaffold", "engine.state_store=distributed")
    clean = run(*overrides)
    with caplog.at_level("WARNING", logger="fl_platform.engine"):
        faulty = run("engine=ray", "engine.num_workers=2", *overrides, "engine.round_timeout_s=10",
                     f"engine.fault_injection.client={victim}", "engine.fault_injection.round=2",
                     f"engine.fault_injection.at={at}")
    assert faulty.engine.restarts == 1
    assert f"sent no result within engine.round_timeout_s=10 s ({step})" in caplog.text, caplog.text[-2000:]
    assert float((faulty.simulation.server.weights - clean.simulation.server.weights).abs().max()) <= 1e-6
    assert results(faulty) == results(clean)


@pytest.mark.parametrize("overrides,message", [
    (("engine.round_timeout_s=5",), r"engine\.round_timeout_s.*needs engine=ray"),
    (("engine=ray", "engine.round_timeout_s=0"), r"engine\.round_timeout_s.*must be > 0"),
])
def test_the_round_timeout_is_checked(overrides, message):
    with pytest.raises(ValueError, match=message):
        build(compose_config(*COMMON, *overrides))


def test_fault_injection_at_is_checked():
    with pytest.raises(ValueError, match=r"engine\.fault_injection\.at.*train, hang, merge, commit or hang_commit"):
        build(compose_config(*COMMON, "engine=ray", "engine.fault_injection.client=3", "engine.fault_injection.at=late"))
    with pytest.raises(ValueError, match=r"engine\.fault_injection\.at.*set that too"):
        build(compose_config(*COMMON, "engine.fault_injection.at=commit"))


def test_explicit_evaluation_on_cuda_without_cuda_stops_the_run(caplog):
    """engine.eval_device=cuda on a driver that cannot use CUDA is an error naming the key (it used to
    evaluate on the CPU with a warning); auto, which the workers' GPUs chose, still falls back."""
    from fl_platform.engine.ray_engine import driver_cuda_device

    if torch.cuda.is_available():
        pytest.skip("this process has CUDA")
    with pytest.raises(RuntimeError, match=r"engine\.eval_device=cuda: Ray holds GPU 1 .*engine\.eval_device=cpu"):
        driver_cuda_device(1, "cuda")
    with caplog.at_level("WARNING"):
        assert driver_cuda_device(1, "auto") == torch.device("cpu")
    assert "evaluating on the CPU" in caplog.text


def test_the_pool_lets_every_live_worker_close_before_killing_any():
    """ActorPool.close: a dead worker's failed close does not cut short the others' (each removes its
    node's state folder); every close is awaited on its own, then every actor is killed."""
    from fl_platform.engine.ray_actors import ActorPool

    class Ref:
        def __init__(self, name: str, dead: bool) -> None:
            self.name, self.dead, self.done = name, dead, False

        def result(self) -> None:
            self.done = True
            if self.dead:
                raise ConnectionError(f"{self.name} died")

    class Actor:
        def __init__(self, name: str, dead: bool = False) -> None:
            self.ref = Ref(name, dead)
            self.close = type("Method", (), {"remote": lambda _: self.ref})()

    killed: dict[str, bool] = {}

    class FakeRay:  # a ref completes when it is waited for or got: a get of a list stops at its first error
        def wait(self, refs, num_returns, timeout):
            for r in refs:
                r.done = True
            return list(refs), []

        def get(self, refs, timeout=None):
            return [r.result() for r in refs] if isinstance(refs, list) else refs.result()

        def kill(self, actor, no_restart=True):
            killed[actor.ref.name] = actor.ref.done

    pool = ActorPool.__new__(ActorPool)  # the actors only: no cluster
    pool._ray, pool.actors = FakeRay(), [Actor("w0", dead=True), Actor("w1"), Actor("w2")]
    pool.close()
    assert killed == {"w0": True, "w1": True, "w2": True} and pool.actors == []


def test_faults_live_outside_the_production_worker():
    """engine.fault_injection builds the workers from faults.py's subclass; every other run builds plain
    Workers, which hold no test code."""
    plain = build(compose_config(*COMMON, "engine.num_workers=2"))
    slowed = build(compose_config(*COMMON, "engine.num_workers=2", "engine.fault_injection.slow_worker=1",
                                  "engine.fault_injection.slow_factor=2"))
    try:
        assert [type(w) for w in plain.engine.workers] == [Worker, Worker]
        assert [type(w) for w in slowed.engine.workers] == [FaultyWorker, FaultyWorker]
        assert slowed.engine.workers[0].faults == Faults(slow_worker=1, slow_factor=2.0)
    finally:
        plain.engine.close()
        slowed.engine.close()


def test_fault_injection_needs_ray():
    with pytest.raises(ValueError, match=r"engine\.fault_injection"):
        build(compose_config(*COMMON, "engine.fault_injection.client=3"))


def poison_client(exp, client: int) -> None:
    """Make one client's features infinite, in the tensors the in-process workers train on."""
    idx = exp.data.client_indices(client)
    for w in exp.engine.workers:
        w.data.train_x[idx] = float("inf")


@pytest.mark.parametrize("cohort", ["1", "4"])
def test_nonfinite_update_fails_the_run_naming_the_client(cohort):
    exp = build(compose_config(*COMMON, "engine.nonfinite=fail", f"engine.cohort_size={cohort}"))
    victim = sample_clients(0, 0, 100, 12)[3]
    poison_client(exp, victim)
    with pytest.raises(NonFiniteError, match=f"client {victim} in round 1"):
        exp.simulation.run()


@pytest.mark.parametrize("algorithm,cohort", [("fedavg", "1"), ("scaffold", "1"), ("fedavg", "4"), ("scaffold", "4")])
def test_nonfinite_update_is_skipped_and_never_averaged(algorithm, cohort):
    """Sequential, and vectorised in chunks of 4 (FedAvg's chunks are summed at once)."""
    victim = sample_clients(0, 0, 100, 12)[3]
    exp = build(compose_config(*COMMON, f"algorithm={algorithm}", "engine.nonfinite=skip", "rounds=1",
                               f"engine.cohort_size={cohort}"))
    poison_client(exp, victim)
    exp.simulation.run()
    row = exp.simulation.history[0]
    assert row["rejected_clients"] == [victim] and row["num_clients"] == 11
    assert bool(torch.isfinite(exp.simulation.server.weights).all())
    if algorithm == "scaffold":  # the rejected client's state was not written
        assert exp.engine.workers[0].store.get(victim) is None
        assert exp.engine.workers[0].store.get(sample_clients(0, 0, 100, 12)[0]) is not None
    # The result equals a round in which the victim did not take part at all.
    ref = build(compose_config(*COMMON, f"algorithm={algorithm}", "rounds=1"))
    for w in ref.engine.workers:
        original = w.client.train

        def train(ctx, cid, *args, _orig=original, **kwargs):
            update = _orig(ctx, cid, *args, **kwargs)
            if cid == victim:
                update.tensors = {k: torch.zeros_like(v) for k, v in update.tensors.items()}
                update.weights = {k: 0.0 for k in update.weights}
            return update

        w.client.train = train
    ref.simulation.run()
    assert float((ref.simulation.server.weights - exp.simulation.server.weights).abs().max()) <= 1e-6


@pytest.mark.ray
def test_ray_engine_refuses_more_workers_than_resources(ray_session):
    with pytest.raises(ValueError, match=r"engine\.num_workers=3 x engine\.cpus_per_worker=1 needs more than the 2 CPUs"):
        build(compose_config(*COMMON, "engine=ray", "engine.num_workers=3"))


def test_close_releases_every_part_when_one_raises():
    """RayEngine.close: the workers, the evaluation slot, the placement group and the Ray it started
    are each released even when an earlier one raises (an unreachable cluster), and the error
    still reaches the caller: nothing holds GPUs or Ray processes after a failed close."""
    from fl_platform.engine.ray_engine import RayEngine

    done: list[str] = []

    class Part:
        def __init__(self, name: str, fails: bool = False) -> None:
            self.name, self.fails = name, fails

        def close(self) -> None:
            done.append(self.name)
            if self.fails:
                raise ConnectionError(f"{self.name} unreachable")

    class FakeRay:
        def kill(self, actor: str) -> None:
            done.append(actor)

        def shutdown(self) -> None:
            done.append("ray")

    engine = RayEngine.__new__(RayEngine)  # the parts only: no cluster
    engine.pool, engine.group = Part("workers", fails=True), Part("group")
    engine._eval_slot, engine._ray, engine._owns_ray = "eval slot", FakeRay(), True
    with pytest.raises(ConnectionError, match="workers unreachable"):
        engine.close()
    assert done == ["workers", "eval slot", "group", "ray"]


def test_a_failed_build_after_the_engine_started_closes_it(monkeypatch):
    """An error between starting the engine and the first round (reporting the workers, the
    evaluation model, restoring a checkpoint) closes the engine: its workers and GPUs are not left
    held in a notebook's process."""
    from fl_platform import experiment

    closed: list[bool] = []
    real = experiment.make_engine

    def make_engine(run, setup):
        engine = real(run, setup)
        close = engine.close
        engine.close = lambda: (closed.append(True), close())[1]
        return engine

    def report_workers(engine, rd):
        raise RuntimeError("report failed")

    monkeypatch.setattr(experiment, "make_engine", make_engine)
    monkeypatch.setattr(experiment, "report_workers", report_workers)
    with pytest.raises(RuntimeError, match="report failed"):
        build(compose_config("rounds=1", "num_clients=4", "clients_per_round=2"))
    assert closed == [True]
