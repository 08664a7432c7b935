"""Bytes each worker puts on the wire, counted where the collectives are launched.

``payload`` is the message a worker contributes (the compressor's exact ``nbytes``: what the
FL runtime calls bytes up); ``wire`` is what a ring algorithm moves per worker for it:
all-reduce 2(n-1)/n * m, all-gather (n-1) * m (compressors.md, "What travels").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CommStats:
    world_size: int = 1
    payload_bytes: int = 0
    wire_bytes: float = 0.0
    collectives: int = 0

    def all_reduce(self, nbytes: int) -> None:
        n = self.world_size
        self.payload_bytes += int(nbytes)
        self.wire_bytes += 2.0 * (n - 1) / n * nbytes
        self.collectives += 1

    def all_gather(self, nbytes: int) -> None:
        self.payload_bytes += int(nbytes)
        self.wire_bytes += float((self.world_size - 1) * nbytes)
        self.collectives += 1

    def snapshot(self) -> tuple[int, float, int]:
        return self.payload_bytes, self.wire_bytes, self.collectives
