"""A ``tokenizers`` Tokenizer rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata.

Byte-level BPE ("gpt2" in llama.cpp's terms): the vocabulary and merges come from the file, the
pre-tokenizer from ``tokenizer.ggml.pre`` (the split the merges were learned with), control
tokens (type 3, e.g. ``<|im_end|>``) become special tokens and user-defined ones (type 4) plain
added tokens, so both stay whole in text.
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


def build_tokenizer(meta: dict) -> tuple[Tokenizer, dict]:
    """(tokenizer, tokenizer_config.json fields) from GGUF metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelConfigError(f"unsupported GGUF tokenizer model {kind!r} (tokenizer.ggml.model); supported: gpt2 (byte-level BPE)")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL_TOKEN])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED_TOKEN])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    cfg = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
           "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id"),
           "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
           "chat_template": meta.get("tokenizer.chat_template")}
    return tok, {k: v for k, v in cfg.items() if v is not None}
