"""Process-group plumbing for the S-SGD runtime: who am I, which device, which shard of the data.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. A run
started without torchrun is a world of one on 127.0.0.1 (a free port), so the same code path
(process group, collectives, DDP) runs everywhere. The backend is gloo on CPU and NCCL on CUDA;
NCCL needs ``torch.cuda.set_device(LOCAL_RANK)`` before its communicators exist, done here.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from fl_platform.seeding import Stream, torch_generator
from fl_platform.training.step import to_device


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (for single-process runs and tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def resolve_device(device: str, local_rank: int) -> torch.device:
    """``auto``: ``cuda:<local rank>`` when CUDA is available, else CPU. ``cuda`` also gets the local rank."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError as err:  # torch's message lists its device types and never names the key
        raise ValueError(f"ssgd.device must be auto, cpu, cuda or cuda:<index>; got {device!r}") from err
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"ssgd.device={device!r} but CUDA is not available; use auto or cpu")
        if dev.index is None:
            dev = torch.device("cuda", local_rank % torch.cuda.device_count())
    return dev


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("ssgd.backend=nccl needs a CUDA device; use gloo on CPU")
    return backend


def init_distributed(backend: str = "auto", device: str = "auto", timeout_s: float = 300.0) -> DistContext:
    """Join the process group torchrun describes (or form a world of one); idempotent."""
    if "RANK" not in os.environ:  # not under torchrun: a world of one on loopback
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    name = resolve_backend(backend, dev)
    if not dist.is_initialized():
        kwargs = {"device_id": dev} if name == "nccl" else {}
        dist.init_process_group(name, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return DistContext(rank, world, local_rank, local_world, dev, dist.get_backend())


def shutdown(barrier: bool = True) -> None:
    """Leave the process group. With ``barrier`` (the normal end of a run), first wait until every rank
    is done, so no rank leaves while a peer still waits on a collective. After an error, skip it (peers
    may be stuck). A torchrun worker then ends with ``end_worker`` (why: there)."""
    if dist.is_initialized():
        try:
            if barrier and dist.get_world_size() > 1:
                dist.barrier()
        finally:
            dist.destroy_process_group()


def end_worker(code: int) -> NoReturn:
    """End a torchrun worker process that has left its process group, without Python's finalisation.

    Why: torch 2.13 keeps the gloo process group of a DDP model alive past ``destroy_process_group``
    (its ``pt_gloo_runloop`` threads live on; DDP's constructor alone is enough). When such a thread
    drops the last reference to a finished collective's tensors while the interpreter finalises, it
    takes the GIL, is ended by Python and the process aborts ("terminate called without an active
    exception", SIGABRT; core dump: ``ProcessGroupGloo::AsyncWork::~AsyncWork`` -> ``decref_pyobject``
    -> ``take_gil`` -> ``pthread_exit``), after a run that succeeded, and torchrun reports it failed.
    Under CPU load 6 of 15 launches of tests/test_ssgd_dist.py's scenarios ended so; 0 of 30 ending here.
    Everything a run writes is closed by then (run files, the Reporter's wandb run), so skipping
    finalisation loses nothing once logging and the standard streams are flushed."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream: nothing left to save
            stream.flush()
    os._exit(code)


def shard_indices(num_samples: int, world_size: int, rank: int, seed: int, epoch: int,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Rank ``rank``'s samples for ``epoch``: a strided slice of one seeded permutation.

    Every rank draws the same permutation of ``range(num_samples)`` from (seed, SHUFFLE, epoch) and
    keeps positions ``rank, rank + W, ...`` of its first ``W * (num_samples // W)`` entries, so the
    shards of an epoch are disjoint, equal in size (every step has the same batch size on every
    rank, which makes the averaged gradient the combined batch's), and differ from epoch to epoch.
    The ``num_samples % W`` samples left over change every epoch (DistributedSampler with drop_last).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    per_rank = num_samples // world_size
    if per_rank == 0:
        raise ValueError(f"{num_samples} training samples cannot be shared by {world_size} workers")
    perm = torch.randperm(num_samples, generator=torch_generator(seed, Stream.SHUFFLE, epoch))
    return to_device(perm[rank : per_rank * world_size : world_size], torch.device(device))  # pinned, non-blocking


def average_(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """All-reduce ``tensor`` in place to the mean over ranks."""
    if world_size > 1:
        dist.all_reduce(tensor)
        tensor.div_(world_size)
    return tensor


def replica_max_abs_diff(vector: torch.Tensor, world_size: int) -> float:
    """max over ranks of max |vector_rank - vector_rank0| (0.0: every replica is identical)."""
    if world_size == 1:
        return 0.0
    reference = vector.detach().clone()
    dist.broadcast(reference, src=0)
    diff = (vector.detach() - reference).abs().max().reshape(1).to(torch.float64)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff.item())
