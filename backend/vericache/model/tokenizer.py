"""A thin wrapper over a Hugging Face ``tokenizer.json`` (via the ``tokenizers`` library)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, path: Path, eos_token_ids: list[int] | None = None) -> None:
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except FileNotFoundError:
            raise FileNotFoundError(f"tokenizer not found: {path}") from None
        except Exception as exc:  # the Rust side raises plain Exception on corrupt JSON
            raise ValueError(f"corrupt tokenizer file {path}: {exc}") from None
        self.eos_token_ids = list(eos_token_ids or [])

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)
