"""What an algorithm declares about itself under client-level DP (kept free of other imports, so the
algorithm API in ``algorithms/base.py`` can use it without importing the privacy machinery)."""

from __future__ import annotations

from dataclasses import dataclass


class PrivacyUnsupported(ValueError):
    """This algorithm (in this configuration) has no sound client-level DP mechanism; says why."""


@dataclass(frozen=True)
class PrivateUploads:
    """An algorithm's uploads under client-level DP (``ClientAlgorithm.private_uploads``).

    ``tensors``: the uploads that carry model information. Each client sends them divided by the
    weight that scales them (``ClientAlgorithm.uploads``), clipped together to L2 norm C; the server
    noises their sum. Uploads not named here are not sent under DP.
    ``weights``: the update's weights, each counting the clients that contributed (1 per client under
    DP); the server replaces each sum by the expected number of clients (a public constant), so the
    algorithm's own server step divides the noised sum by it. Weights not named here are not sent.
    """

    tensors: tuple[str, ...]
    weights: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.tensors:
            raise ValueError("PrivateUploads.tensors is empty: nothing would be clipped")
