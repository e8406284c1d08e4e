"""A ``tokenizers`` Tokenizer rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata.

Two vocabularies, as llama.cpp names them in ``tokenizer.ggml.model``:
- "gpt2", byte-level BPE (Llama 3, Qwen, SmolLM): the vocabulary and merges come from the file, the
  pre-tokenizer from ``tokenizer.ggml.pre`` (the split the merges were learned with);
- "llama", SentencePiece BPE (Llama 2, Mistral 7B): spaces become "▁" and a "▁" starts the text
  (``tokenizer.ggml.add_space_prefix``), pieces merge best score first (``tokenizer.ggml.scores``;
  the file has no merges), a character outside the vocabulary falls back to its ``<0xNN>`` byte tokens.
In both, control tokens (type 3, e.g. ``<|im_end|>``, ``</s>``) become special tokens and user-defined
ones (type 4, e.g. ``<think>``) plain added tokens, so both stay whole in text.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from vericache.config import ModelConfigError

CONTROL_TOKEN, USER_DEFINED_TOKEN = 3, 4
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) -> how text is split before BPE
DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva")
GPT2 = ("default", "gpt2", "gpt-2")
REGEX_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


def _pre_tokenizer(pre: str):
    if pre in DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in REGEX_SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(REGEX_SPLITS[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    known = DIGITS_THEN_GPT2 + GPT2 + tuple(REGEX_SPLITS)
    raise ModelConfigError(f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: {', '.join(known)}")


def _byte_level(meta: dict, tokens: list[str]) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    return tok


def merges_by_score(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece's merge order as BPE merges: every split of a piece into two pieces of the
    vocabulary, the piece with the higher score merged first (ties: the longer left part, then right;
    then by the parts' ids)."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for piece, score in dict(zip(tokens, scores)).items():
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in ids and piece[i:] in ids]
        splits.sort(key=lambda lr: (ids[lr[0]], ids[lr[1]]))
        found += [(left, right, score) for left, right in splits]
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)   # stable: id order kept in ties
    return [(left, right) for left, right, _ in found]


def _sentencepiece(meta: dict, tokens: list[str]) -> Tokenizer:
    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]] if "tokenizer.ggml.merges" in meta \
        else merges_by_score(tokens, scores)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=True,
                               byte_fallback=True, unk_token=tokens[unk] if unk is not None else None))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return tok


TOKENIZER_MODELS = {"gpt2": _byte_level, "llama": _sentencepiece}   # tokenizer.ggml.model -> builder


def build_tokenizer(meta: dict) -> tuple[Tokenizer, dict]:
    """(tokenizer, tokenizer_config.json fields) from GGUF metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise ModelConfigError(f"unsupported GGUF tokenizer model {kind!r} (tokenizer.ggml.model); supported: "
                               "gpt2 (byte-level BPE), llama (SentencePiece BPE)")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok = TOKENIZER_MODELS[kind](meta, tokens)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL_TOKEN])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED_TOKEN])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    cfg = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
           "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id"),
           # llama.cpp starts a SentencePiece text with BOS unless the file says otherwise
           "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
           "chat_template": meta.get("tokenizer.chat_template")}
    return tok, {k: v for k, v in cfg.items() if v is not None}
