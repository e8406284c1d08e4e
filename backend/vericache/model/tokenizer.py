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
        self.chat_template, self.special, self.add_bos = self._read_config(Path(path).parent / "tokenizer_config.json")
        self.bos_token_id = self._tok.token_to_id(self.special["bos_token"]) if "bos_token" in self.special else None

    @staticmethod
    def _read_config(path: Path) -> tuple[str | None, dict[str, str], bool]:
        """The chat template, special-token strings and add_bos_token of tokenizer_config.json, if any."""
        import json

        if not path.exists():
            return None, {}, False
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"corrupt {path}: {exc}") from None

        def token(v):
            return v.get("content") if isinstance(v, dict) else v

        special = {k: token(cfg[k]) for k in ("bos_token", "eos_token") if cfg.get(k)}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return template, special, bool(cfg.get("add_bos_token", False))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token markup (e.g. ``<|im_end|>``) maps to its one id.

        A BOS id is prepended when the tokenizer config asks for it (``add_bos_token``).
        """
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; with ``skip_special_tokens=False`` markup such as ``<|im_start|>`` stays,
        so ``encode(decode(ids, False)) == ids`` (a prompt can travel as text)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)
