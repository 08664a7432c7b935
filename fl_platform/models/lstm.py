"""Character LSTM for next-character prediction (LEAF Shakespeare)."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from fl_platform.models._common import check_num_classes
from fl_platform.models.base import StagedModel


class LastStepLSTM(nn.Module):
    """A batch-first ``nn.LSTM`` that returns the top layer's output at the last time step.

    A stage must map one tensor to one tensor; dropping the (h, c) state here keeps the
    staged contract. Parameters are read from the module at every call (nothing cached), so
    re-pointing them to views of a flat buffer is safe. On CUDA, cuDNN then warns that the
    weights are not one contiguous chunk and copies them per call: correct, a little slower.
    """

    def __init__(self, input_size: int, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden, num_layers=num_layers, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return out[:, -1, :]


class CharLSTM(StagedModel):
    """LEAF's Shakespeare model: embedding (8) -> 2-layer LSTM (256) -> linear head.

    Input: int64 character ids ``[B, T]``; output: logits ``[B, num_classes]`` for the next
    character. Stages: ``embed, lstm, head``.
    """

    input_dtype = torch.long
    input_rank = 1
    accepts = "integer token-id sequences (seq_len,), as dataset=shakespeare gives"

    def __init__(
        self,
        vocab_size: int,
        num_classes: int | None = None,
        embed_dim: int = 8,
        hidden: int = 256,
        num_layers: int = 2,
        seq_len: int = 80,
    ) -> None:
        vocab_size = check_num_classes(vocab_size)
        num_classes = vocab_size if num_classes is None else check_num_classes(num_classes)
        if min(int(embed_dim), int(hidden), int(num_layers), int(seq_len)) < 1:
            raise ValueError("embed_dim, hidden, num_layers and seq_len must be positive")
        stages: OrderedDict[str, nn.Module] = OrderedDict(
            embed=nn.Embedding(vocab_size, int(embed_dim)),
            lstm=LastStepLSTM(int(embed_dim), int(hidden), int(num_layers)),
            head=nn.Linear(int(hidden), num_classes),
        )
        super().__init__(stages, (int(seq_len),))
        self.vocab_size = vocab_size
