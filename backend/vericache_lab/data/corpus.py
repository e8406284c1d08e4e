"""The code corpus (the running interpreter's standard library) and the tokenizer trained on it."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"


def stdlib_files() -> list[Path]:
    """Every .py file of the standard library, sorted, site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(f for f in root.rglob("*.py") if "site-packages" not in f.parts and f.is_file())


def is_heldout(path: Path) -> bool:
    """A deterministic ~2% of files, chosen by a hash of the path relative to the stdlib root."""
    rel = path.relative_to(Path(sysconfig.get_paths()["stdlib"])).as_posix()
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 50 == 0


def read_split(heldout: bool) -> list[str]:
    return [text for _, text in read_split_files(heldout)]


def read_split_files(heldout: bool) -> list[tuple[str, str]]:
    """(path relative to the stdlib root, text) of each file of the split, in path order."""
    root, files = Path(sysconfig.get_paths()["stdlib"]), []
    for f in stdlib_files():
        if is_heldout(f) == heldout:
            try:
                files.append((f.relative_to(root).as_posix(), f.read_text(encoding="utf-8")))
            except (UnicodeDecodeError, OSError):
                continue
    return files


def train_tokenizer(texts: list[str], vocab_size: int = 4096) -> Tokenizer:
    """Byte-level BPE; digits are split one per token so numbers copy digit by digit."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok
