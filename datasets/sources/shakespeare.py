"""Tiny Shakespeare as a naturally partitioned next-character task (one client per speaker).

LEAF's Shakespeare needs the complete works; this builds the same kind of task from Karpathy's
``input.txt``: blocks ``NAME:\\n lines...`` separated by blank lines. Each speaker's lines are joined
(newlines become spaces and runs of spaces collapse, as LEAF's preprocessing does), split by position
into the first ``train_fraction`` and the rest (so no window spans both splits), and cut into windows
of ``seq_len`` characters labelled with the next character.
"""

from __future__ import annotations

import logging
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Literal

import numpy as np

from fl_platform.datasets.download import fetch
from fl_platform.datasets.paths import DatasetNotFoundError, data_root
from fl_platform.datasets.source import SourceData

log = logging.getLogger(__name__)

# LEAF's 80-character vocabulary (models/utils/language_utils.py), so LEAF-sized models fit.
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
UNK = "<unk>"
_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
_MD5 = "6fb458f1232090904fb40fe944165e91"
_SPEAKER = re.compile(r"^([^\n:][^\n]*):$")


def parse_speakers(text: str) -> dict[str, str]:
    """Map each speaker name to all of its speech, lines joined by single spaces."""
    speeches: dict[str, list[str]] = defaultdict(list)
    for block in re.split(r"\n[ \t]*\n", text):
        lines = block.strip("\n").split("\n")
        match = _SPEAKER.match(lines[0].strip()) if lines else None
        if match is None or len(lines) < 2:
            continue
        speeches[match.group(1).strip()].append(" ".join(line.strip() for line in lines[1:]))
    return {name: re.sub(r" {2,}", " ", " ".join(parts)).strip() for name, parts in speeches.items()}


def build_vocab(kind: Literal["leaf", "file"], text: str) -> tuple[list[str], np.ndarray]:
    """Vocabulary and a 256-entry byte -> id table.

    ``leaf``: LEAF's 80 characters; a character outside it maps to the space (tiny Shakespeare has
    one, a '$' typo). ``file``: the sorted characters of the text plus ``<unk>`` for anything else.
    """
    if kind == "leaf":
        vocab = list(LEAF_LETTERS)
        fallback = vocab.index(" ")
    elif kind == "file":
        vocab = [*sorted(set(text)), UNK]
        fallback = len(vocab) - 1
    else:
        raise ValueError(f"shakespeare: vocab must be 'leaf' or 'file', got {kind!r}")
    table = np.full(256, fallback, dtype=np.int64)
    for i, ch in enumerate(vocab):
        if len(ch) == 1 and ord(ch) < 256:
            table[ord(ch)] = i
    return vocab, table


def _encode(text: str, table: np.ndarray, fallback: int) -> np.ndarray:
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return np.where(codes < len(table), table[np.minimum(codes, len(table) - 1)], fallback)


def _windows(ids: np.ndarray, seq_len: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    if len(ids) <= seq_len:
        return np.empty((0, seq_len), np.int64), np.empty(0, np.int64)
    view = np.lib.stride_tricks.sliding_window_view(ids, seq_len + 1)[::stride]
    return np.ascontiguousarray(view[:, :seq_len]), np.ascontiguousarray(view[:, seq_len])


def find_text(root: str | os.PathLike[str] | None, download: bool) -> Path:
    base = data_root(root)
    candidates = [
        base / "tiny-shakespeare" / "input.txt",
        base / "tinyshakespeare" / "input.txt",
        base / "input.txt",
    ]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None and download:
        found = fetch("shakespeare", [_URL], candidates[0], md5=_MD5)
    if found is None:
        raise DatasetNotFoundError("shakespeare", candidates, f"Pass download=True to fetch {_URL}.")
    return found


def load_shakespeare(
    root: str | os.PathLike[str] | None = None,
    download: bool = False,
    seed: int = 0,
    *,
    seq_len: int = 80,
    stride: int = 20,
    max_speakers: int | None = None,
    min_chars: int = 0,
    train_fraction: float = 0.8,
    vocab: Literal["leaf", "file"] = "leaf",
) -> SourceData:
    """Next-character windows grouped by speaker (group ids in sorted speaker-name order).

    Only speakers with at least one train and one test window (and ``min_chars`` characters) are
    kept, so train and test hold the same clients as in LEAF; ``max_speakers`` keeps the first N of
    those. ``seed`` is accepted for a uniform signature and ignored (the split is by position).
    """
    del seed
    if seq_len < 1 or stride < 1:
        raise ValueError(f"shakespeare: seq_len and stride must be >= 1, got {seq_len}, {stride}")
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"shakespeare: train_fraction must be in (0, 1), got {train_fraction}")
    if max_speakers is not None and max_speakers < 1:
        raise ValueError(f"shakespeare: max_speakers must be >= 1 or None, got {max_speakers}")
    path = find_text(root, download)
    text = path.read_text(encoding="utf-8", errors="replace")
    speakers = parse_speakers(text)
    vocab_list, table = build_vocab(vocab, text)
    fallback = int(table[ord(" ")]) if vocab == "leaf" else len(vocab_list) - 1

    names: list[str] = []
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("trx", "try", "tex", "tey")}
    few_chars, short = [], []
    for name in sorted(speakers):
        speech = speakers[name]
        if len(speech) < min_chars:
            few_chars.append(name)
            continue
        ids = _encode(speech, table, fallback)
        cut = int(len(ids) * train_fraction)
        trx, try_ = _windows(ids[:cut], seq_len, stride)
        tex, tey = _windows(ids[cut:], seq_len, stride)
        if len(try_) == 0 or len(tey) == 0:
            short.append(name)
            continue
        names.append(name)
        for key, arr in zip(("trx", "try", "tex", "tey"), (trx, try_, tex, tey)):
            parts[key].append(arr)
        if max_speakers is not None and len(names) == max_speakers:
            break
    if few_chars or short:
        log.warning("shakespeare: %d speaker(s) of %s left out: %d with fewer than min_chars=%d characters, %d with "
                    "too little text for a train and a test window of seq_len=%d (e.g. %r)", len(few_chars) + len(short),
                    path, len(few_chars), min_chars, len(short), seq_len, (few_chars + short)[0])
    if not names:
        raise ValueError(f"shakespeare: no speaker in {path} has enough text for seq_len={seq_len}")
    counts_train = [len(a) for a in parts["try"]]
    counts_test = [len(a) for a in parts["tey"]]
    ids_all = np.arange(len(names), dtype=np.int64)
    return SourceData(
        train_x=np.concatenate(parts["trx"]),
        train_y=np.concatenate(parts["try"]),
        test_x=np.concatenate(parts["tex"]),
        test_y=np.concatenate(parts["tey"]),
        num_classes=len(vocab_list),
        input_shape=(seq_len,),
        name="shakespeare",
        train_groups=np.repeat(ids_all, counts_train),
        test_groups=np.repeat(ids_all, counts_test),
        vocab=vocab_list,
        group_names=names,
    )
