"""Turn an experiment's Hydra config into a Flower ``--run-config`` file.

    python -m fl_platform.flower.export_config algorithm=fedprox algorithm.mu=0.1 num_clients=10 \\
        clients_per_round=10 deploy.round_timeout=120 -o fedprox.toml
    flwr run . my-federation --run-config fedprox.toml

Overrides are exactly those of ``python -m fl_platform.run`` (plus ``deploy.*`` keys), so an
experiment tuned in simulation is deployed with the same settings. ``--from-config
<run_dir>/config.yaml`` exports a finished simulation run's resolved config instead.
``--pyproject`` prints the ``[tool.flwr.app.config]`` defaults for pyproject.toml (regenerate
them when a built-in config group gains an option or a field: the SuperLink refuses unknown keys).
A plug-in's or custom model's/loader's own fields need no regeneration: the exported run config
carries the keys pyproject does not list in its JSON key ``extra``. (``--pyproject`` with overrides
still adds the keys of the config they compose, for those who prefer them listed.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from fl_platform.flower.config import (
    DEPLOY,
    DeployConf,
    check_keys,
    compose,
    default_run_config,
    flatten_config,
    from_run_config,
    pyproject_defaults,
    to_toml,
)


def parse_deploy(items: list[str]) -> DeployConf:
    values: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"expected {DEPLOY}.<key>=<value>, got {item!r}")
        values[key[len(DEPLOY) + 1:]] = yaml.safe_load(raw) if raw else ""
    return DeployConf.from_flat(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fl_platform.flower.export_config",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (as for fl_platform.run) and deploy.* keys")
    parser.add_argument("-o", "--output", type=Path, help="write the TOML here (default: stdout)")
    parser.add_argument("--from-config", type=Path, help="a run directory's resolved config.yaml to export")
    parser.add_argument("--pyproject", action="store_true",
                        help="print the [tool.flwr.app.config] defaults for pyproject.toml")
    args = parser.parse_args(argv)
    deploy_items = [o for o in args.overrides if o.startswith(f"{DEPLOY}.")]
    hydra_overrides = [o for o in args.overrides if not o.startswith(f"{DEPLOY}.")]
    try:
        deploy = parse_deploy(deploy_items)
        if args.pyproject:
            if deploy_items or args.from_config:
                raise ValueError("--pyproject takes no deploy.* keys and no --from-config")
            text = to_toml(default_run_config(hydra_overrides), "tool.flwr.app.config")
        else:
            if args.from_config is not None:
                if hydra_overrides:
                    raise ValueError("give either --from-config or Hydra overrides, not both")
                cfg = OmegaConf.load(args.from_config)
            else:
                cfg = compose(hydra_overrides)
            flat = flatten_config(cfg, deploy)
            from_run_config(flat)  # fail here, not on the SuperLink, when it does not compose back
            defaults = pyproject_defaults()
            if defaults is not None:
                check_keys(flat, defaults)
            text = to_toml(flat)
    except Exception as err:  # Hydra's composition errors name the bad key
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
        print(f"wrote {args.output}; run it with: flwr run . <federation> --run-config {args.output}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
