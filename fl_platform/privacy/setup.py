"""A run's privacy config checked at start-up, and the client and server halves built for it.

Used by ``experiment.py`` (the simulator: inline and Ray), by the Flower ClientApp and ServerApp,
so every runtime refuses the same configurations with the same messages.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fl_platform.privacy.config import PrivacyConf, check_values, privacy_conf
from fl_platform.privacy.spec import PrivacyUnsupported, PrivateUploads

if TYPE_CHECKING:
    from fl_platform.run_config import RunConfig

log = logging.getLogger(__name__)


def private_uploads_of(spec: Any, alg_conf: Any, mode: str = "central") -> PrivateUploads:
    """What the algorithm clips and noises under DP; PrivacyUnsupported (naming the algorithm) if nothing sound."""
    name = spec.name
    if not spec.server.summable:
        raise PrivacyUnsupported(
            f"algorithm={name} is refused under privacy={mode}: its server takes each client's upload whole "
            "(list mode: one-shot ensembles, distillation, fusion), while client-level DP here clips every update "
            "and noises their sum; no sound mechanism for its server step is implemented")
    try:
        return spec.client.private_uploads(alg_conf)
    except PrivacyUnsupported as err:
        raise PrivacyUnsupported(f"algorithm={name} is refused under privacy={mode}: {err}") from None


def check_privacy(run: RunConfig, spec: Any, alg_conf: Any) -> PrivacyConf:
    """The run's PrivacyConf, or ValueError naming the key (``privacy.*`` or ``algorithm``)."""
    conf = privacy_conf(run.get("privacy"))
    check_values(conf, run.num_clients, run.clients_per_round)
    if conf.name == "none":
        return conf
    # dp-accounting imports SciPy (about 1 s and 60 MB): only for runs with privacy.
    from fl_platform.privacy.accounting import check_covered

    private_uploads_of(spec, alg_conf, conf.name)
    n = run.num_clients
    if conf.delta > n ** -1.1:
        log.warning("privacy.delta=%g is above num_clients^-1.1 = %.3g: a mechanism that releases a few clients' "
                    "data outright meets a delta near 1/num_clients; prefer delta well below (e.g. %.1g)",
                    conf.delta, n ** -1.1, 10 ** math.floor(math.log10(n ** -1.1)))
    check_covered(conf.name, conf.accountant, conf.sampling, run.num_clients, run.clients_per_round)
    return conf


def resolved_privacy(run: RunConfig) -> PrivacyConf:
    """The run's PrivacyConf with ``noise_multiplier=null`` replaced by the smallest z that meets
    ``target_epsilon`` after ``rounds`` rounds, checked again with that z.

    Every party takes its z from here (``make_setup``: the simulator's driver and workers, each Flower
    ClientApp and the ServerApp), so a client's local noise and adaptive clipping's count noise never
    see an unresolved null: they used to read it as 0, i.e. no noise, while the server accounted for z."""
    conf = privacy_conf(run.get("privacy"))
    if conf.name == "none" or conf.noise_multiplier is not None:
        return conf
    from fl_platform.privacy.accounting import noise_multiplier_for

    num_clients, clients_per_round = run.num_clients, run.clients_per_round
    z = noise_multiplier_for(conf.target_epsilon, conf.delta, run.rounds, num_clients=num_clients,
                             clients_per_round=clients_per_round, sampling=conf.sampling,
                             accountant=conf.accountant, mode=conf.name, seed=run.seed)
    log.info("privacy: noise multiplier %.4f meets epsilon %g at delta %g after %d rounds", z,
             conf.target_epsilon, conf.delta, run.rounds)
    conf = dataclasses.replace(conf, noise_multiplier=z)
    check_values(conf, num_clients, clients_per_round)
    return conf


SAMPLING_SEED_KEY = "sampling_secret"  # in the checkpointed privacy state: a deployment's secret cohort seed


def deployed(conf: PrivacyConf | None) -> PrivacyConf | None:
    """A Flower deployment's privacy config: ``secure_rng`` on, whatever the run config says. Every client
    is sent the run's seed (it draws its minibatches from it), so noise from that seed would be known to
    all of them; the server and each client draw theirs from their own OS CSPRNG instead."""
    if conf is None or conf.name == "none":
        return conf
    return dataclasses.replace(conf, secure_rng=True)


def secret_sampling_seed(conf: PrivacyConf | None, kept: Mapping[str, Any] | None = None) -> int | None:
    """A Flower deployment's seed for the cohorts under DP: 128 bits from the server's OS CSPRNG, kept on the
    server (the accountant's amplification by sampling assumes the cohorts hidden, and every client is sent
    the run's seed); None without DP (the cohorts of the run's seed, as the simulator draws them).

    ``kept``: the privacy state of the checkpoint a run resumes from. Its secret is reused, so the rounds
    after the restart draw the cohorts of an uninterrupted run and local DP's accountant, which recounts
    each client's participations from the seed, counts the cohorts that ran (a fresh secret would recount
    rounds that never ran)."""
    if conf is None or conf.name == "none":
        return None
    if kept is not None and kept.get(SAMPLING_SEED_KEY) is not None:
        return int(kept[SAMPLING_SEED_KEY])
    import secrets

    return secrets.randbits(128)


def make_client_privacy(conf: PrivacyConf | None, spec: Any, alg_conf: Any):
    """The client half (``clipping.ClientPrivacy``), or None for ``privacy=none``."""
    if conf is None or conf.name == "none":
        return None
    from fl_platform.privacy.clipping import ClientPrivacy

    return ClientPrivacy(conf, private_uploads_of(spec, alg_conf, conf.name), spec.client.uploads(alg_conf))


def make_server_privacy(conf: PrivacyConf | None, spec: Any, alg_conf: Any, sizes: dict[str, int], *,
                        num_clients: int, clients_per_round: int, rounds: int, seed: int, secret_seed: bool = False):
    """The server half (``server.ServerPrivacy``), or None for ``privacy=none``. ``sizes``: the
    contribution's tensor sizes (``compression.uplink.contribution_sizes``); ``secret_seed``: ``seed`` is a
    deployment's secret cohort seed."""
    if conf is None or conf.name == "none":
        return None
    from fl_platform.privacy.server import ServerPrivacy

    return ServerPrivacy(conf, private_uploads_of(spec, alg_conf, conf.name), sizes, num_clients=num_clients,
                         clients_per_round=clients_per_round, rounds=rounds, seed=seed, secret_seed=secret_seed)


def server_privacy_for(conf: PrivacyConf | None, spec: Any, alg_conf: Any, alg_setup: Any, fm: Any, *,
                       num_clients: int, clients_per_round: int, rounds: int, seed: int):
    """``make_server_privacy`` with the contribution sizes read off a client half built for ``fm``'s model
    (built with torch's RNG set aside, so the run's draws do not depend on privacy being on)."""
    if conf is None or conf.name == "none":
        return None
    import torch

    from fl_platform.compression.uplink import contribution_sizes

    with torch.random.fork_rng(devices=[]):
        client = spec.client(alg_conf, alg_setup)
    return make_server_privacy(conf, spec, alg_conf, contribution_sizes(client, fm), num_clients=num_clients,
                               clients_per_round=clients_per_round, rounds=rounds, seed=seed)
