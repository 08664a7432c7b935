#!/usr/bin/env python
"""Compressor benchmark: encode + decode time, bytes and relative error on a ResNet-18-sized vector.

    python scripts/bench/compression.py                 # writes its section of docs/benchmarks.md
    python scripts/bench/compression.py --reps 5 --device cuda --no-doc

The vector is a real gradient: CIFAR ResNet-18 (11.2 M parameters, BatchNorm) on one batch of 32
random 3x32x32 images with random labels, laid out as the flat model vector. Compressors run
layer-wise over the model's slots (BatchNorm running statistics are not part of a gradient;
1-D tensors are compressed like the others except by the low-rank methods, which send them
dense), except ``global`` rows (one Top-k over all parameters). Times are the median of
``--reps`` runs after one warm-up; error is ||decode(encode(g)) - g|| / ||g|| for one shot
without error feedback (PowerSGD from its initial random Q, i.e. no warm start yet).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, hardware_line, write_section

from fl_platform.compression import (
    ACPSGD,
    QSGD,
    Identity,
    Key,
    Layout,
    PowerSGD,
    RandomK,
    ScaledSign,
    Sign,
    TopK,
    VectorCompressor,
)
from fl_platform.models import build_model
from fl_platform.training.flat import FlatModel

CASES = [
    ("identity (dense fp32)", Identity(), "layer"),
    ("top-k 1% (int32 idx)", TopK(0.01, "int32"), "layer"),
    ("top-k 1% global", TopK(0.01, "int32"), "global"),
    ("top-k 0.1%", TopK(0.001), "layer"),
    ("top-k 10% (bitmap)", TopK(0.1), "layer"),
    ("random-k 1% (shared seed)", RandomK(0.01), "layer"),
    ("QSGD 8 bit, bucket 512", QSGD(8, 512), "layer"),
    ("QSGD 4 bit, bucket 512", QSGD(4, 512), "layer"),
    ("QSGD 2 bit, bucket 512", QSGD(2, 512), "layer"),
    ("sign (1 bit)", Sign(), "layer"),
    ("EF-sign (1 bit + scale)", ScaledSign(), "layer"),
    ("PowerSGD rank 1", PowerSGD(1), "layer"),
    ("PowerSGD rank 4", PowerSGD(4), "layer"),
    ("ACP-SGD rank 4 (P-step)", ACPSGD(4), "layer"),
]


def summable_text(comp) -> str:
    if isinstance(comp, PowerSGD):
        return "no (all-reduce via the P/Q protocol)"
    return "yes" if comp.summable else "no"


def resnet18_gradient(device: torch.device) -> tuple[FlatModel, torch.Tensor]:
    torch.manual_seed(0)
    fm = FlatModel(build_model("resnet18", (3, 32, 32), 10), device)
    x = torch.randn(32, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (32,), device=device)
    fm.grad.zero_()
    torch.nn.functional.cross_entropy(fm.model(x), y).backward()
    return fm, fm.grad.detach().clone()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(vc: VectorCompressor, g: torch.Tensor, reps: int, device: torch.device) -> dict[str, float]:
    key = Key(seed=0, step=1, sender=0)
    payload, state = vc.encode(g, None, key)  # warm-up; this first shot gives the error
    decoded = vc.decode(payload, state)
    err = float((decoded - g).norm() / g.norm())
    enc, dec = [], []
    for r in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        p, st = vc.encode(g, None, Key(seed=0, step=2 + r, sender=0))
        _sync(device)
        t1 = time.perf_counter()
        vc.decode(p, st)
        _sync(device)
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    return {"bytes": payload.nbytes, "ratio": payload.nbytes / (4 * g.numel()), "error": err,
            "encode_ms": 1e3 * statistics.median(enc), "decode_ms": 1e3 * statistics.median(dec)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--doc", type=Path, default=REPO / "docs" / "benchmarks.md")
    ap.add_argument("--no-doc", action="store_true", help="print the table only")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    fm, g = resnet18_gradient(device)
    layouts = {scope: Layout.from_slots(fm.slots, fm.num_params, scope) for scope in ("layer", "global")}
    rows = []
    for label, comp, scope in CASES:
        m = measure(VectorCompressor(comp, layouts[scope]), g, args.reps, device)
        rows.append((label, m))
        print(f"{label:28s} {m['bytes'] / 2**20:9.3f} MiB  x{1 / m['ratio']:7.1f}  err {m['error']:.3f}  "
              f"enc {m['encode_ms']:8.1f} ms  dec {m['decode_ms']:8.1f} ms", flush=True)
    lines = [
        "## Compressors on a ResNet-18-sized vector",
        "",
        f"`python scripts/bench/compression.py --reps {args.reps} --device {args.device}`"
        + (f" `--threads {args.threads}`" if args.threads else "") + f" on {hardware_line()}, "
        f"{torch.get_num_threads()} torch threads (a machine shared with other jobs: times are indicative).",
        "",
        f"Vector: the gradient of CIFAR ResNet-18 ({fm.param_count:,} parameters, {sum(s.is_param for s in fm.slots)} "
        "tensors) on one batch of 32 random images; layer-wise unless marked global. Error: "
        "||decode(encode(g)) - g|| / ||g||, one shot, no error feedback (PowerSGD from a random Q). Time: "
        f"median of {args.reps} runs after a warm-up.",
        "",
        "| compressor | bytes | compression | relative error | encode (ms) | decode (ms) | summable |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for (label, m), (_, comp, _) in zip(rows, CASES):
        lines.append(f"| {label} | {m['bytes']:,} | {1 / m['ratio']:.1f}x | {m['error']:.3f} | "
                     f"{m['encode_ms']:.1f} | {m['decode_ms']:.1f} | {summable_text(comp)} |")
    lines += ["", "Bytes are `Payload.nbytes`, the length of the serialised payload (values fp32, indices int32 "
              "or a bitmap, signs and QSGD levels bit-packed, one fp32 norm per QSGD bucket). Random-k sends "
              "no indices (shared seed) but regenerates its O(d) permutation on both sides. ACP-SGD's Q-step payload "
              "has the other factor's size. Errors by design: unbiased random-k scales by d/k, so its error is "
              "sqrt(d/k - 1) ~ 10 at 1 %; plain sign decodes to +-1 (a direction, scaled by the learning rate), "
              "so its error against the raw gradient is not meaningful; the low-rank rows are one shot from a "
              "random start (warm start and error feedback make them converge over steps)."]
    body = "\n".join(lines)
    if args.no_doc:
        print(body)
    else:
        write_section(args.doc, "compression", body)
        print(f"wrote the compression section of {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
