"""Compressors shared by FL client uploads and S-SGD gradient all-reduce (docs/compression.md).

Per tensor: :class:`Compressor` (``encode`` / ``decode`` / exact ``nbytes`` / ``summable``),
one module per method, :class:`ErrorFeedback` for the residual. Over a flat vector:
:class:`Layout` and :class:`VectorCompressor`. By name: :func:`make_compressor`.
"""

from fl_platform.compression.acpsgd import ACPSGD
from fl_platform.compression.base import NO_KEY, Compressor, Key, Payload, State
from fl_platform.compression.errorfeedback import ErrorFeedback, ef_encode
from fl_platform.compression.identity import Identity
from fl_platform.compression.powersgd import PowerSGD
from fl_platform.compression.qsgd import QSGD
from fl_platform.compression.randomk import RandomK
from fl_platform.compression.registry import build_compressor, compressor_names, make_compressor
from fl_platform.compression.sign import ScaledSign, Sign
from fl_platform.compression.topk import TopK
from fl_platform.compression.vector import Layout, Segment, VectorCompressor, VectorPayload

__all__ = [
    "ACPSGD", "NO_KEY", "QSGD", "Compressor", "ErrorFeedback", "Identity", "Key", "Layout", "Payload",
    "PowerSGD", "RandomK", "ScaledSign", "Segment", "Sign", "State", "TopK", "VectorCompressor",
    "VectorPayload", "build_compressor", "compressor_names", "ef_encode", "make_compressor",
]
