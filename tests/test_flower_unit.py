"""Flower deployment pieces, in-process (no Flower processes): run config, records, state, strategy.

The whole ServerApp/ClientApp path runs here over ``LocalGrid`` (messages delivered straight to
our ClientApp), so equality with the simulator, SCAFFOLD's per-client state, dropouts and the
rejection of bad replies are checked in seconds; tests/test_flower_deploy.py repeats the key
scenarios with real SuperLink/SuperNode processes.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import re
import sys
import zipfile
from io import BytesIO
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from omegaconf import OmegaConf

from fl_platform.algorithms.registry import get_algorithm
from fl_platform.compression.uplink import contribution_sizes, uploads_of
from fl_platform.core import Broadcast, ClientUpdate, Metrics, RoundContext
from fl_platform.experiment import build, load_data, make_setup, run_experiment
from fl_platform.flower import config as fc
from fl_platform.flower.client_app import NodeSettings, build_runtime
from fl_platform.flower.client_app import app as client_app
from fl_platform.flower.export_config import main as export_main
from fl_platform.flower.records import (
    INFO,
    UPDATE,
    InvalidReply,
    decode_train,
    decode_update,
    encode_train,
    encode_update,
    message_nbytes,
)
from fl_platform.flower.server_app import run_server
from fl_platform.flower.state import ContextStateStore, state_tensor
from fl_platform.flower.strategy import AlgorithmStrategy, NotEnoughReplies
from fl_platform.run_config import read_config
from fl_platform.seeding import Stream, seed_torch_global
from fl_platform.training.flat import FlatModel

pytestmark = pytest.mark.slow  # most tests run Flower's server and client apps through whole rounds

_spec = importlib.util.spec_from_file_location("flower_utils", Path(__file__).with_name("flower_utils.py"))
flower_utils = sys.modules.setdefault("flower_utils", importlib.util.module_from_spec(_spec))
if not hasattr(flower_utils, "LocalGrid"):
    _spec.loader.exec_module(flower_utils)
LocalGrid = flower_utils.LocalGrid

SMALL = ["num_clients=3", "clients_per_round=3", "rounds=3", "partition=iid", "train.epochs=1",
         "logger.progress=false"]


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """The ClientApp sets torch's threads from the node config (threads=1 here) for the whole process."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run_config(*overrides: str, **deploy) -> dict:
    deploy.setdefault("round_timeout", 5.0)
    deploy.setdefault("poll_interval", 0.01)
    deploy.setdefault("connect_timeout", 5.0)
    return fc.flatten_config(fc.compose([*SMALL, *overrides]), fc.DeployConf(**deploy))


def nodes(n: int = 3) -> list[dict]:
    # threads=1: the ClientApp sets torch's threads (for this whole process): a shared machine
    return [{"partition-id": i, "num-partitions": n, "threads": 1} for i in range(n)]


def container(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


# ---------------------------------------------------------------- run config


@pytest.mark.parametrize("overrides", [
    ["algorithm=fedprox", "algorithm.mu=0.1", "model=cnn", "train.steps=7"],
    ["algorithm=scaffold", "algorithm.weighting=uniform", "partition=dirichlet", "partition.alpha=0.3",
     "train.clip_norm=2.5", "dataset.root=/some/where"],
    ["model.hidden=[64,32]", "train.optimizer=adam", "seed=7"],
])
def test_run_config_round_trip(overrides):
    cfg = fc.compose(overrides)
    flat = fc.flatten_config(cfg, fc.DeployConf(round_timeout=12.5, min_replies=2))
    assert all(isinstance(v, bool | int | float | str) for v in flat.values())
    back, deploy = fc.from_run_config(flat)
    assert container(back) == container(cfg)
    assert (deploy.round_timeout, deploy.min_replies) == (12.5, 2)


def test_pyproject_defaults_compose_to_the_default_experiment():
    defaults = fc.pyproject_defaults()
    assert defaults is not None, "pyproject.toml lacks [tool.flwr.app.config]"
    cfg, deploy = fc.from_run_config(defaults)
    assert container(cfg) == container(fc.compose())
    assert deploy == fc.DeployConf()
    # choosing another option in a run config picks up that option's own defaults
    chosen = {**defaults, "algorithm.name": "fedprox"}
    assert fc.from_run_config(chosen)[0].algorithm.mu == fc.compose(["algorithm=fedprox"]).algorithm.mu
    # every key of the built-ins is listed (a key added to conf/ without regenerating fails here)
    missing = sorted(set(fc.default_run_config()) - set(defaults))
    assert not missing, (f"[tool.flwr.app.config] lacks {missing}: regenerate it with "
                         "`python -m fl_platform.flower.export_config --pyproject`")


def test_run_config_errors_name_the_key():
    flat = run_config()
    with pytest.raises(ValueError, match="mu"):
        fc.from_run_config({**flat, "algorithm.mu": 0.5})  # fedavg has no mu
    with pytest.raises(ValueError, match=re.escape("deploy.'round_timout'")):
        fc.from_run_config({**flat, "deploy.round_timout": 3.0})
    with pytest.raises(ValueError, match=re.escape("deploy.min_replies must be >= 1")):
        fc.from_run_config({**flat, "deploy.min_replies": 0})
    with pytest.raises(ValueError, match=re.escape("deploy.round_timeout must be a float")):
        fc.from_run_config({**flat, "deploy.round_timeout": "soon"})
    with pytest.raises(ValueError, match=re.escape("not in [tool.flwr.app.config]")):
        fc.check_keys({"nonsense": 1}, fc.pyproject_defaults())


def test_export_config_cli_writes_a_run_config_flower_reads(tmp_path, capsys):
    from flwr.common.config import parse_config_args

    out = tmp_path / "exp.toml"
    assert export_main(["algorithm=fedprox", "algorithm.mu=0.25", "num_clients=4", "deploy.round_timeout=30",
                        "-o", str(out)]) == 0
    flat = parse_config_args([str(out)])  # exactly how `flwr run --run-config exp.toml` reads it
    cfg, deploy = fc.from_run_config(flat)
    assert (cfg.algorithm.name, cfg.algorithm.mu, cfg.num_clients, deploy.round_timeout) == ("fedprox", 0.25, 4, 30.0)
    assert export_main(["algorithm.muu=1"]) == 1
    assert "muu" in capsys.readouterr().err
    # a finished simulation run's config.yaml exports too
    saved = tmp_path / "config.yaml"
    saved.write_text(OmegaConf.to_yaml(fc.compose(["algorithm=scaffold", "rounds=4"])))
    assert export_main(["--from-config", str(saved), "-o", str(out)]) == 0
    assert fc.from_run_config(parse_config_args([str(out)]))[0].rounds == 4


@pytest.mark.parametrize(("overrides", "message"), [
    (["eval.clients=all"], "eval.clients=all: not carried to a Flower deployment"),
    (["eval.finetune_steps=3"], "eval.finetune_steps=3: not carried"),
    (["engine.nonfinite=skip"], "engine.nonfinite=skip: not carried"),
    (["engine=ray", "engine.deterministic=true"], "engine.deterministic=True: not carried"),
    (["engine.cohort_size=2"], "engine.cohort_size=2: not carried"),
    (["system=uniform"], "a system model (system.name=sampled) is not implemented for Flower deployments"),
    (["system=trace", "system.trace=t.csv"], "a system model (system.name=trace) is not implemented"),
])
def test_a_setting_the_run_config_cannot_carry_is_refused_not_dropped(tmp_path, capsys, overrides, message):
    """The run config has no engine.* or eval.* key and the ServerApp no system model: such a setting used to
    export with rc 0 and run as the defaults (eval.clients=all gave the baseline's row; system=uniform died
    later composing 'system/sampled'). Refused at export, from a run's config.yaml too, and by the ServerApp;
    engine's scheduling keys, which change no result, still export."""
    from fl_platform.config_checks import check_flower_server

    assert export_main(overrides) == 1
    assert message in capsys.readouterr().err
    saved = tmp_path / "config.yaml"
    saved.write_text(OmegaConf.to_yaml(fc.compose(overrides)))
    assert export_main(["--from-config", str(saved)]) == 1
    assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match=re.escape(message)):
        check_flower_server(read_config(fc.compose(overrides)))
    assert export_main(["engine=ray", "engine.num_workers=3", "engine.cpus_per_worker=2"]) == 0


# ---------------------------------------------------------------- records and state


def test_records_round_trip_and_sizes():
    ctx = RoundContext(round=4, seed=3, clients=(1, 5, 9), num_rounds=10, num_clients=12)
    bc = Broadcast({"weights": torch.randn(50), "stats": torch.randn(3, 4, dtype=torch.float64)},
                   {"lambda": 0.5}, {5: {"rho": 0.25}, 9: {"rho": 1.0}})
    ctx2, bc2, cid = decode_train(encode_train(ctx, bc, 5))
    assert (ctx2, cid) == (RoundContext(round=4, seed=3, clients=(5,), num_rounds=10, num_clients=12), 5)  # not the cohort
    assert bc2.scalars == {"lambda": 0.5} and bc2.per_client == {5: {"rho": 0.25}}
    for k, t in bc.tensors.items():
        assert bc2.tensors[k].dtype == t.dtype and torch.equal(bc2.tensors[k], t)
    metrics = Metrics()
    metrics.add("train_loss", 3.0, 6)
    update = ClientUpdate(5, {"delta": torch.randn(50), "mask": torch.ones(2, 3)}, {"n": 6.0, "clients": 1.0}, 6,
                          metrics, bytes_up=77)
    content = encode_update(update)
    back = decode_update(content)
    assert back.client_id == 5 and back.num_samples == 6 and back.bytes_up == 77
    assert back.weights == update.weights and back.metrics.values == {"train_loss": [3.0, 6.0]}
    assert all(torch.equal(back.tensors[k], t) for k, t in update.tensors.items())
    flower_utils.LocalGrid(client_app, [], {})  # sets Flower's task identity so messages can be built
    msg = Message(content, dst_node_id=7, message_type="train")
    assert message_nbytes(msg) > 50 * 4 + 6 * 4
    with pytest.raises(InvalidReply, match="lacks records"):
        decode_update(RecordDict({UPDATE: content[UPDATE]}))
    bad = encode_update(update)
    bad[INFO]["num_samples"] = 1.5
    with pytest.raises(InvalidReply, match="num_samples"):
        decode_update(bad)


def test_context_state_store():
    from fl_platform.algorithms.base import StateSpec

    record = RecordDict()
    store = ContextStateStore(record, {"c": StateSpec(4)})
    assert store.get(2) is None
    store.put(2, {"c": torch.arange(4.0)})
    assert torch.equal(store.get(2)["c"], torch.arange(4.0))
    assert store.clients() == [2] and torch.equal(state_tensor(record, 2, "c"), torch.arange(4.0))
    with pytest.raises(ValueError, match="elements"):
        store.put(2, {"c": torch.zeros(5)})
    with pytest.raises(KeyError, match="not declared"):
        store.put(2, {"other": torch.zeros(4)})


def test_node_settings_errors():
    with pytest.raises(ValueError, match="partition-id"):
        NodeSettings.from_node_config({"partition_id": 0})
    with pytest.raises(ValueError, match="data-mode"):
        NodeSettings.from_node_config({"partition-id": 0, "data-mode": "remote"})
    with pytest.raises(ValueError, match="num-partitions=5 but the run has num_clients=3"):
        build_runtime(run_config(), {"partition-id": 0, "num-partitions": 5})


def test_local_data_mode_uses_every_sample_of_the_nodes_dataset():
    rt = build_runtime(run_config(), {"partition-id": 2, "data-mode": "local"})
    part = build_runtime(run_config(), {"partition-id": 2})
    assert rt.client_id == 2 and rt.data.num_samples > 2 * part.data.num_samples


# ---------------------------------------------------------------- the ServerApp over an in-process grid


def weights_of(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(Path(run_dir) / "model.pt", weights_only=True)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


FUSEFL = ["algorithm=fusefl", "model=cnn", "model.channels=[8,16]", "model.hidden=32", "algorithm.blocks=2",
          "algorithm.sample_per_class=50"]


@pytest.mark.parametrize("overrides", [["algorithm=fedprox"], FUSEFL, ["num_clients=5", "clients_per_round=2"]],
                         ids=["fedprox", "fusefl-list-mode", "2-of-5-sampled"])
def test_flower_run_equals_the_simulator(tmp_path, overrides):
    """FedProx (summable, a training hook), FuseFL (non-summable: the server gets the replies as a
    list sorted by client id; per-client state across rounds) and FedAvg with 2 of 5 clients sampled
    per round (the same clients as the simulator) through the ServerApp/ClientApp."""
    cfg = fc.compose([*SMALL, *overrides])
    rc = run_config(*overrides)
    grid = LocalGrid(client_app, nodes(cfg.num_clients), rc)
    summary = run_server(grid, rc, run_id=5, run_dir=tmp_path / "flower")
    sim = run_experiment(cfg, tmp_path / "sim")
    assert max_diff(weights_of(tmp_path / "flower"), weights_of(tmp_path / "sim")) < 1e-5
    assert summary["final_test_accuracy"] == pytest.approx(sim["final_test_accuracy"])
    rows = [json.loads(line) for line in (tmp_path / "flower" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(r["num_clients"] == cfg.clients_per_round and r["bytes_up"] > r["payload_bytes_up"] > 0
               and r["bytes_down"] > 0 for r in rows)
    for name in ("config.yaml", "summary.json", "partition.npz", "run_config.toml", "server.log"):
        assert (tmp_path / "flower" / name).exists(), name


def test_scaffold_keeps_each_clients_control_variate_across_rounds(tmp_path):
    rc = run_config("algorithm=scaffold")
    grid = LocalGrid(client_app, nodes(), rc)
    history: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}

    def snapshot(reply: Message) -> Message:
        ctx = grid.contexts[reply.metadata.src_node_id]
        if reply.metadata.message_type == "train":
            cid = ctx.node_config["partition-id"]
            history[cid].append(state_tensor(ctx.state, cid, "c").clone())
        return reply

    grid.tamper = snapshot
    run_server(grid, rc, run_dir=tmp_path / "flower")
    exp = build(fc.compose([*SMALL, "algorithm=scaffold"]), tmp_path / "sim")
    exp.simulation.run()
    sim_weights = exp.simulation.server.weights
    flower_weights = exp.simulation.eval_model.vector_from_state_dict(weights_of(tmp_path / "flower"))
    assert float((flower_weights - sim_weights).abs().max()) < 1e-5
    for cid, cs in history.items():
        assert len(cs) == 3 and float(cs[0].norm()) > 0
        assert not torch.equal(cs[0], cs[1]) and not torch.equal(cs[1], cs[2])
        store = getattr(exp.engine.workers[0], "store", None) if hasattr(exp.engine, "workers") else None
        if store is not None:  # the simulator's control variate for the same client
            assert torch.allclose(store.get(cid)["c"], cs[-1], atol=1e-5)

    # control: a node that loses its state between rounds ends elsewhere
    grid2 = LocalGrid(client_app, nodes(), rc)

    def forget(reply: Message) -> Message:
        grid2.contexts[reply.metadata.src_node_id].state = RecordDict()
        return reply

    grid2.tamper = forget
    run_server(grid2, rc, run_dir=tmp_path / "forgetful")
    assert max_diff(weights_of(tmp_path / "forgetful"), weights_of(tmp_path / "flower")) > 1e-4


def dies_at_first_train(grid, node_id: int, known: bool = False) -> None:
    """The node answers the identify query, then never again (a device that dropped off);
    ``known``: the SuperLink noticed and answers for it with "node unavailable"."""
    push = grid.push_messages

    def push_and_maybe_die(messages):
        messages = list(messages)
        if any(m.metadata.message_type == "train" for m in messages):
            (grid.unavailable if known else grid.down).add(node_id)
        return push(messages)

    grid.push_messages = push_and_maybe_die


def test_identify_queries_in_flight_are_bounded(tmp_path):
    """deploy.identify_in_flight=2 over 5 nodes: never more than 2 identify queries outstanding (each starts a
    ClientApp process on its node), every node still asked and holding its client; unbounded, all 5 at once."""
    from fl_platform.flower.records import IDENTIFY

    def peak_outstanding(**deploy) -> int:
        rc = run_config("num_clients=5", "clients_per_round=5", "rounds=1", **deploy)
        grid = LocalGrid(client_app, nodes(5), rc)
        outstanding: set[str] = set()
        peak = [0]
        push, pull = grid.push_messages, grid.pull_messages

        def push_counting(messages):
            messages = list(messages)
            ids = push(messages)
            outstanding.update(i for m, i in zip(messages, ids) if m.metadata.message_type == IDENTIFY)
            peak[0] = max(peak[0], len(outstanding))
            return ids

        def pull_counting(ids):
            got = pull(ids)
            outstanding.difference_update(r.metadata.reply_to_message_id for r in got)
            return got

        grid.push_messages, grid.pull_messages = push_counting, pull_counting
        summary = run_server(grid, rc, run_dir=tmp_path / f"run{len(deploy)}")
        assert summary["rounds"] == 1 and len(summary["nodes"]) == 5
        return peak[0]

    bounded = peak_outstanding(identify_in_flight=2)
    unbounded = peak_outstanding()
    assert (bounded, unbounded) == (2, 5)
    with pytest.raises(ValueError, match=r"deploy\.identify_in_flight must be >= 0"):
        fc.DeployConf(identify_in_flight=-1)


def test_a_node_that_never_answers_is_left_out_and_logged(tmp_path):
    rc = run_config(round_timeout=0.3, min_replies=2)
    grid = LocalGrid(client_app, nodes(), rc)
    dies_at_first_train(grid, 1001)  # holds client 1
    summary = run_server(grid, rc, run_dir=tmp_path / "run")
    assert summary["rounds"] == 3
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["num_clients"] == 2 and r["rejected_clients"] == [1] for r in rows)
    assert "no reply within" in rows[0]["rejected_reasons"]["1"]
    log_text = (tmp_path / "run" / "server.log").read_text()
    assert "WARNING" in log_text and "client 1 rejected: no reply within" in log_text

    grid2 = LocalGrid(client_app, nodes(), rc)
    dies_at_first_train(grid2, 1002, known=True)
    run_server(grid2, rc, run_dir=tmp_path / "run2")
    rows = [json.loads(line) for line in (tmp_path / "run2" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rejected_clients"] == [2] and "Node Unavailable" in r["rejected_reasons"]["2"] for r in rows)

    rc3 = run_config(round_timeout=0.3, min_replies=3)
    grid3 = LocalGrid(client_app, nodes(), rc3)
    dies_at_first_train(grid3, 1002)
    with pytest.raises(NotEnoughReplies, match=re.escape("deploy.min_replies=3")):
        run_server(grid3, rc3, run_dir=tmp_path / "run3")


def test_strategy_rejects_wrong_shapes_and_non_finite_replies(caplog):
    """Flower's Strategy API (configure_train / aggregate_train) with three tampered replies of four."""
    n = 4
    rc = run_config(f"num_clients={n}", f"clients_per_round={n}")
    grid = LocalGrid(client_app, nodes(n), rc)
    cfg, deploy = fc.from_run_config(rc)

    cfg = read_config(cfg)
    data = load_data(cfg)
    setup = make_setup(cfg, data)
    seed_torch_global(cfg.seed, Stream.INIT)
    fm = FlatModel(setup.model())
    server = get_algorithm("fedavg").server(setup.algorithm_conf, setup.algorithm_setup(fm.num_params, fm.num_buffers),
                                            fm.vector.detach().clone())
    initial = server.weights.clone()
    client = get_algorithm("fedavg").client(setup.algorithm_conf, setup.algorithm_setup(fm.num_params, fm.num_buffers))
    strategy = AlgorithmStrategy(server, seed=cfg.seed, num_rounds=1, num_clients=n, clients_per_round=n, deploy=deploy,
                                 expected_sizes=contribution_sizes(client, fm))
    strategy.connect(grid)
    good: dict[int, ClientUpdate] = {}

    def tamper(reply: Message) -> Message:
        update = decode_update(reply.content)
        if update.client_id == 0:  # a wrong shape
            update.tensors["delta"] = update.tensors["delta"][:-1].clone()
        elif update.client_id == 1:  # NaN
            update.tensors["delta"][3] = math.nan
        elif update.client_id == 2:  # inf in a weight
            update.weights["n"] = math.inf
        else:
            good[update.client_id] = update
            return reply
        return Message(encode_update(update), reply_to=grid.pushed[-1])

    grid.tamper = tamper
    with caplog.at_level(logging.WARNING, logger="fl_platform"):
        messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
        replies = grid.send_and_receive(messages)
        arrays, metrics = strategy.aggregate_train(1, replies)
    assert metrics["num_clients"] == 1
    expected = initial + good[3].tensors["delta"] / good[3].weights["n"]
    assert torch.allclose(server.weights, expected, atol=1e-6)
    assert torch.equal(torch.from_numpy(arrays["weights"].numpy()), server.weights)
    text = caplog.text
    assert (f"client 0 rejected: wrong tensors 'delta': shape ({len(fm) - 1},) torch.float32, expected ({len(fm)},) "
            "floating point") in text
    assert "client 1 rejected: non-finite values in ['delta']" in text
    assert "client 2 rejected: malformed reply: weight 'n' must be a finite number" in text


def test_replies_every_client_could_agree_on_are_still_checked_against_the_run(caplog):
    """The round's consensus accepts what most replies share, so one sampled client (or all of them) could
    send a delta of another shape (the server step then crashed), of integers (folded in), none at all (a
    silent no-op round), a negative weight, or a metric that overwrites a server column (num_clients,
    test_accuracy on a round without evaluation): each is now rejected naming why, and the good reply is
    the round."""
    n = 6
    rc = run_config(f"num_clients={n}", f"clients_per_round={n}")
    grid = LocalGrid(client_app, nodes(n), rc)
    cfg = read_config(fc.from_run_config(rc)[0])
    setup = make_setup(cfg, load_data(cfg))
    seed_torch_global(cfg.seed, Stream.INIT)
    fm = FlatModel(setup.model())
    alg_setup = setup.algorithm_setup(fm.num_params, fm.num_buffers)
    server = get_algorithm("fedavg").server(setup.algorithm_conf, alg_setup, fm.vector.detach().clone())
    initial = server.weights.clone()
    client = get_algorithm("fedavg").client(setup.algorithm_conf, alg_setup)
    strategy = AlgorithmStrategy(server, seed=cfg.seed, num_rounds=1, num_clients=n, clients_per_round=n,
                                 deploy=fc.from_run_config(rc)[1], expected_sizes=contribution_sizes(client, fm),
                                 uploads=uploads_of(client))
    strategy.connect(grid)
    good: dict[int, ClientUpdate] = {}

    def tamper(reply: Message) -> Message:
        update = decode_update(reply.content)
        cid = update.client_id
        if cid == 0:
            update.tensors["delta"] = update.tensors["delta"].reshape(-1, 1)
        elif cid == 1:
            update.tensors["delta"] = update.tensors["delta"].to(torch.int32)
        elif cid == 2:
            update.tensors = {}
        elif cid == 3:
            update.weights["n"] = -1e6
        elif cid == 4:
            update.metrics.add("test_accuracy", 0.999)
        else:
            good[cid] = update
            return reply
        return Message(encode_update(update), reply_to=grid.pushed[-1])

    grid.tamper = tamper
    with caplog.at_level(logging.WARNING, logger="fl_platform"):
        replies = grid.send_and_receive(list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid)))
        _, metrics = strategy.aggregate_train(1, replies)
    assert metrics["num_clients"] == 1 and "test_accuracy" not in metrics
    assert torch.allclose(server.weights, initial + good[5].tensors["delta"] / good[5].weights["n"], atol=1e-6)
    text = caplog.text
    assert f"client 0 rejected: wrong tensors 'delta': shape ({len(fm)}, 1)" in text
    assert "client 1 rejected: wrong tensors 'delta': shape" in text and "torch.int32" in text
    assert "client 2 rejected: carries none of its uploads ['delta'] (it sends [])" in text
    assert "client 3 rejected: weights {'n': -1000000.0} must be finite numbers >= 0" in text
    assert "client 4 rejected: malformed reply: metric 'test_accuracy' is a column the server writes" in text


def test_a_top_k_payload_with_indices_its_encoder_cannot_make_is_refused():
    """A negative index would wrap to the last coordinate and be folded in silently; one past the end, or a
    bitmap with more bits than values, raised a raw IndexError: check_payload refuses each before decode."""
    from fl_platform.compression.topk import TopK

    for index in ("int32", "bitmap"):
        comp = TopK(0.1, index)
        payload, _ = comp.encode(torch.randn(100))
        comp.check_payload(payload)  # its own output passes
        tensors = dict(payload.tensors)
        if index == "int32":
            bad = [(torch.cat([torch.tensor([-1], dtype=torch.int32), tensors["indices"][1:]]), "must lie in [0, 100)"),
                   (torch.cat([tensors["indices"][:-1], torch.tensor([100], dtype=torch.int32)]), "must lie in [0, 100)"),
                   (torch.cat([tensors["indices"][:1], tensors["indices"][:-1]]), "strictly ascending")]  # repeated
            for idx, message in bad:
                with pytest.raises(ValueError, match=re.escape(message)):
                    comp.check_payload(type(payload)({**tensors, "indices": idx}, payload.shape, payload.dtype))
        else:
            full = torch.full_like(tensors["bitmap"], 255)
            with pytest.raises(ValueError, match="bitmap marks 100 coordinates for 10 values"):
                comp.check_payload(type(payload)({**tensors, "bitmap": full}, payload.shape, payload.dtype))
    # the server's codec checks every part of a reply's payload (here behind error feedback)
    from fl_platform.compression.registry import TopKConf
    from fl_platform.compression.uplink import make_uplink
    from fl_platform.flower.payloads import PayloadCodec

    fm = FlatModel(torch.nn.Linear(10, 10))
    codec = PayloadCodec(make_uplink(TopKConf(ratio=0.1, index="int32"), fm, object()))
    ctx = RoundContext(round=0, seed=0, clients=(0,), num_rounds=1, num_clients=1)
    data = bytearray(codec.uplink.encode(ctx, 0, "delta", torch.randn(len(fm)), None, 1.0)[0].to_bytes())
    codec.unpack_one(ctx, 0, "delta", len(fm), bytes(data))
    data[0:4] = (-1).to_bytes(4, "little", signed=True)  # the first index of the first part
    with pytest.raises(ValueError, match=re.escape("top-k indices must lie in [0, ")):
        codec.unpack_one(ctx, 0, "delta", len(fm), bytes(data))


def test_fab_holds_the_app_and_nothing_heavy(tmp_path):
    """`flwr run .` packages the app and nothing heavy; the staged folder the deployment tests run
    (flower_utils.stage_app) packages the very same FAB."""
    from flwr.cli.build import build_fab_from_disk

    root = Path(__file__).resolve().parents[1]
    fab = build_fab_from_disk(root)
    assert build_fab_from_disk(flower_utils.stage_app(tmp_path / "app")) == fab
    names = zipfile.ZipFile(BytesIO(fab)).namelist()
    for needed in ("fl_platform/flower/server_app.py", "fl_platform/flower/client_app.py", "conf/config.yaml",
                   "algorithms/fedavg.py", "datasets/federated.py", "pyproject.toml"):
        assert needed in names, needed
    assert not [n for n in names if n.startswith((".venv", "outputs", "multirun", "tests", ".git"))]
    assert len(fab) < 5 * 2**20


def test_consensus_rejects_a_reply_shaped_unlike_the_others():
    ctx = RoundContext(round=0, seed=0, clients=(0, 1, 2), num_rounds=1, num_clients=3)
    updates = [ClientUpdate(i, {"delta": torch.zeros(4), "delta_c": torch.zeros(2 if i == 1 else 3)}, {"n": 1.0}, 1)
               for i in (2, 1, 0)]
    rejected: dict[int, str] = {}
    kept = AlgorithmStrategy.consensus(ctx, updates, rejected)
    assert [u.client_id for u in kept] == [0, 2]
    assert list(rejected) == [1] and "'delta_c': (2,)" in rejected[1]


@pytest.mark.parametrize("compressor", ["topk", "powersgd", "sign"])
def test_compressed_uplinks_travel_as_payload_bytes_and_match_the_simulator(tmp_path, compressor):
    """The simulator's uplink hook on the client (residuals in context.state); the payload's bytes on the
    wire; the server decodes them to exactly what the simulator aggregates."""
    over = [f"compressor={compressor}"] + (["compressor.ratio=0.05"] if compressor == "topk" else [])
    rc = run_config(*over)
    grid = LocalGrid(client_app, nodes(), rc)
    run_server(grid, rc, run_dir=tmp_path / "flower")
    run_experiment(fc.compose([*SMALL, *over]), tmp_path / "sim")
    weights = weights_of(tmp_path / "flower")
    assert max_diff(weights, weights_of(tmp_path / "sim")) < 1e-5
    dense = 3 * 4 * sum(t.numel() for t in weights.values())  # three clients' delta as float32
    f_rows = [json.loads(line) for line in (tmp_path / "flower" / "metrics.jsonl").read_text().splitlines()]
    s_rows = [json.loads(line) for line in (tmp_path / "sim" / "metrics.jsonl").read_text().splitlines()]
    for f, s in zip(f_rows, s_rows):
        assert f["payload_bytes_up"] == s["bytes_up"] < 0.2 * dense
        assert f["payload_bytes_up"] < f["bytes_up"] < f["payload_bytes_up"] + 3 * 4096  # plus Flower's framing
        assert f["upload_ratio"] == pytest.approx(s["upload_ratio"])
    for ctx in grid.contexts.values():
        if compressor == "sign":  # stateless (and n_k-scaled on both ends: the weights match the simulator's)
            continue
        keys = ctx.state.array_records[f"client-{ctx.node_config['partition-id']}"].keys()
        assert any(k.startswith("ef.") for k in keys), list(keys)


# ---------------------------------------------------------------- checkpoint/resume


class ServerAppKilled(Exception):
    """The ServerApp process dies (raised inside the grid: nothing after it runs)."""


def dies_at_round(grid, round_number: int) -> None:
    push = grid.push_messages

    def push_or_die(messages):
        messages = list(messages)
        if any(m.metadata.message_type == "train" and m.metadata.group_id == str(round_number) for m in messages):
            raise ServerAppKilled(f"killed before round {round_number}")
        return push(messages)

    grid.push_messages = push_or_die


def trained_rounds(grid) -> list[int]:
    return sorted({int(m.metadata.group_id) for m in grid.pushed if m.metadata.message_type == "train"})


def test_a_killed_flower_run_resumes_from_its_checkpoint_to_the_uninterrupted_result(tmp_path):
    """checkpoint_every=1: the ServerApp dies as round 3 starts; a new run (fresh SuperNode contexts, as a new
    `flwr run` gets) with the same run config trains only round 3 and ends as the uninterrupted run."""
    rc = run_config("algorithm=fedprox", "checkpoint_every=1")
    full = LocalGrid(client_app, nodes(), rc)
    run_server(full, rc, run_dir=tmp_path / "full")
    killed = LocalGrid(client_app, nodes(), rc)
    dies_at_round(killed, 3)
    with pytest.raises(ServerAppKilled):
        run_server(killed, rc, run_dir=tmp_path / "resumed")
    assert trained_rounds(killed) == [1, 2]
    assert (tmp_path / "resumed" / "checkpoint" / "LATEST").read_text().strip() == "round-00000002"
    assert not (tmp_path / "resumed" / "summary.json").exists()
    again = LocalGrid(client_app, nodes(), rc, run_id=2)
    summary = run_server(again, rc, run_id=2, run_dir=tmp_path / "resumed")
    assert trained_rounds(again) == [3]
    assert max_diff(weights_of(tmp_path / "resumed"), weights_of(tmp_path / "full")) < 1e-6
    rows = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    for a, b in zip(rows, ref):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
        assert a["test_accuracy"] == pytest.approx(b["test_accuracy"], abs=1e-9)
    assert summary["rounds"] == 3 and summary["final_test_accuracy"] == pytest.approx(
        json.loads((tmp_path / "full" / "summary.json").read_text())["final_test_accuracy"], abs=1e-9)
    assert "resumed from" in (tmp_path / "resumed" / "server.log").read_text()

    # resume=never starts over: all three rounds trained again
    rc_never = run_config("algorithm=fedprox", "checkpoint_every=1", "resume=never")
    over = LocalGrid(client_app, nodes(), rc_never, run_id=3)
    run_server(over, rc_never, run_id=3, run_dir=tmp_path / "resumed")
    assert trained_rounds(over) == [1, 2, 3]


def test_a_restarted_dp_deployment_draws_its_cohorts_from_the_secret_it_checkpointed(tmp_path):
    """Local DP, 2 of 6 clients a round: the ServerApp dies as round 3 starts and a new one resumes. The
    cohorts of all three rounds (before and after the restart) are those of the one secret in the
    checkpoint, and the logged worst participation count is that of the cohorts that ran (a fresh secret
    on restart made the accountant recount rounds 1-2 from cohorts that never ran)."""
    from fl_platform.privacy.setup import SAMPLING_SEED_KEY
    from fl_platform.rounds.checkpoint import Checkpointer
    from fl_platform.rounds.sampling import sample_clients
    from fl_platform.rounds.simulation import PRIVACY_STATE

    rc = run_config("num_clients=6", "clients_per_round=2", "checkpoint_every=1", "privacy=local",
                    "privacy.clip=1.0", "privacy.noise_multiplier=1.0", "privacy.delta=1e-3", "privacy.sampling=fixed")
    killed = LocalGrid(client_app, nodes(6), rc)
    dies_at_round(killed, 3)
    with pytest.raises(ServerAppKilled):
        run_server(killed, rc, run_dir=tmp_path / "run")
    before = Checkpointer(tmp_path / "run" / "checkpoint", 1).load().server[PRIVACY_STATE][SAMPLING_SEED_KEY]
    again = LocalGrid(client_app, nodes(6), rc, run_id=2)
    run_server(again, rc, run_id=2, run_dir=tmp_path / "run")
    secret = Checkpointer(tmp_path / "run" / "checkpoint", 1).load().server[PRIVACY_STATE][SAMPLING_SEED_KEY]
    assert secret == before and secret.bit_length() > 64

    def cohorts(grid) -> dict[int, set[int]]:
        out: dict[int, set[int]] = {}
        for m in grid.pushed:
            if m.metadata.message_type == "train":
                out.setdefault(int(m.metadata.group_id), set()).add(m.metadata.dst_node_id - 1000)
        return out

    ran = {**cohorts(killed), **cohorts(again)}
    assert sorted(ran) == [1, 2, 3]
    assert ran == {r + 1: set(sample_clients(secret, r, 6, 2)) for r in range(3)}
    counts = [sum(c in ran[r] for r in ran) for c in range(6)]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["dp_max_participations"] == max(counts)


def test_resume_is_refused_when_the_clients_state_lived_on_the_supernodes(tmp_path):
    """SCAFFOLD's c_i is in each SuperNode's per-run context.state: a new run cannot have it, and must not
    silently start the clients from zero."""
    rc = run_config("algorithm=scaffold", "checkpoint_every=1")
    killed = LocalGrid(client_app, nodes(), rc)
    dies_at_round(killed, 2)
    with pytest.raises(ServerAppKilled):
        run_server(killed, rc, run_dir=tmp_path / "run")
    again = LocalGrid(client_app, nodes(), rc, run_id=2)
    with pytest.raises(ValueError, match=r"after round 1: scaffold keeps per-client state on the SuperNodes "
                                         r"\(c\).*resume=never"):
        run_server(again, rc, run_id=2, run_dir=tmp_path / "run")
    assert not [m for m in again.pushed if m.metadata.message_type == "train"]


def test_flower_run_dir_with_checkpoints_is_stable_for_the_same_run_config():
    from fl_platform.flower.server_app import default_run_dir

    cfg = fc.compose([*SMALL, "checkpoint_every=2"])
    rc = run_config("checkpoint_every=2")
    same = default_run_dir(cfg, 1, rc)
    assert same == default_run_dir(cfg, 7, {**rc, "deploy.round_timeout": 9.0, "checkpoint_every": 3})
    assert same != default_run_dir(cfg, 1, {**rc, "train.lr": 0.5})
    assert default_run_dir(fc.compose([*SMALL, "resume=/x/y"]), 1, rc) == Path("/x/y")
