"""``vericache train-tiny``: train the bundled code model on this CPU, resumably.

Recipe (see MODEL_CARD.md for the figures):
- data: standard-library code (a held-out ~2% of files is never trained on) mixed with
  synthetic retrieval and tool-call tasks (training layouts only);
- curriculum: short, copy-heavy windows first (a copy mechanism forms there), then
  longer windows with a falling task share, up to ``max_len`` tokens;
- AdamW, warm-up then cosine decay over the time budget; checkpoints every few
  minutes (model, optimiser, data RNG, elapsed time), so a killed run resumes;
- every checkpoint also exports a Hugging Face directory and appends a line of
  metrics (held-out loss, retrieval and tool-call exact match on held-out
  layouts) to ``curve.jsonl``.
The curriculum follows elapsed time, so the schedule is reproducible given the
same time budget and seed, but step counts depend on machine speed.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from vericache.config import ModelConfig
from vericache.model.llama import Transformer
from vericache.model.tokenizer import Tokenizer
from vericache_lab.data import corpus
from vericache_lab.data.tasks import retrieval_task, tool_call_task
from vericache_lab.eval.model_quality import heldout_loss, retrieval_exact_match, toolcall_exact_match

# (fraction of the time budget at which the stage starts, window length, share of task documents)
CURRICULA = {
    # from scratch: learn code first, lengthen towards 2048
    "base": ((0.0, 256, 0.7), (0.15, 512, 0.55), (0.35, 1024, 0.45), (0.6, 2048, 0.4)),
    # continuation of a model that already writes code: a long short-and-copy-heavy stage first
    # (where the pilot saw copying form), then lengthen
    "copy": ((0.0, 256, 0.85), (0.45, 512, 0.7), (0.65, 1024, 0.6), (0.85, 2048, 0.5)),
}


@dataclass
class TrainConfig:
    out: str
    minutes: float = 120.0
    seed: int = 0
    max_len: int = 2048
    tokens_per_batch: int = 4096
    lr: float = 2e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    checkpoint_minutes: float = 5.0
    bf16: bool = False
    threads: int = 0
    hidden_size: int = 256
    layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 768
    vocab_size: int = 4096
    rope_theta: float = 100000.0
    curriculum: str = "base"
    init_from: str | None = None  # a Hugging Face directory to start from (same tokenizer)
    answer_weight: float = 4.0  # loss weight of answer tokens in task documents (copying is rare)
    repeat_share: float = 0.0   # share of task documents that are a repeated code span (induction data)


def model_config(tc: TrainConfig, eot_id: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_hidden_layers=tc.layers, num_attention_heads=tc.heads, num_key_value_heads=tc.kv_heads,
        max_position_embeddings=32 * tc.max_len, rope_theta=tc.rope_theta, tie_word_embeddings=True,
        bos_token_id=eot_id, eos_token_id=[eot_id],
    )


class DataSource:
    """Code windows and task documents, drawn from one seeded RNG (saved in checkpoints)."""

    def __init__(self, tok: Tokenizer, code: list[int], seed: int, repeat_share: float = 0.0) -> None:
        self.tok, self.code, self.rng = tok, code, random.Random(seed)
        self.repeat_share = repeat_share
        self.newline = tok.encode("\n")

    def code_window(self, length: int) -> list[int]:
        start = self.rng.randrange(len(self.code) - length - 1)
        return self.code[start : start + length]

    def task_document(self, length: int) -> tuple[list[int], list[bool]]:
        """A context literal, code filler, then queries, filling exactly ``length`` tokens.

        Returns the tokens and, per token, whether it belongs to an answer (copied from far back).
        """
        rng = self.rng
        short = length <= 256
        for _ in range(8):
            if rng.random() < 0.3:
                task = tool_call_task(rng, n_events=rng.randint(2, 8 if short else 22))
            else:
                max_e = 12 if short else max(12, length // 24)
                task = retrieval_task(rng, rng.randint(2, max_e), n_queries=rng.randint(1, 6 if short else 4))
            head = self.tok.encode(task.context)
            # prompt and answer encoded apart, as at evaluation (the model then writes the answer)
            queries = [(self.tok.encode("\n" + p), self.tok.encode(a)) for p, a in task.queries]
            room = length - len(head) - sum(len(q) + len(a) for q, a in queries)
            if room >= 0:
                break
        else:
            return self.code_window(length), [False] * length
        # Split the filler: some code before the literal, the rest between queries.
        cuts = sorted(rng.randint(0, room) for _ in range(len(queries) + 1))
        pieces = [cuts[0]] + [b - a for a, b in zip(cuts, cuts[1:])] + [room - cuts[-1]]
        doc = (self.code_window(pieces[0]) if pieces[0] else []) + head
        doc += self.code_window(pieces[1]) if pieces[1] else []
        answer = [False] * len(doc)
        for (q, a), n in zip(queries, pieces[2:]):
            filler = self.code_window(n) if n else []
            doc += q + a + filler
            answer += [False] * len(q) + [True] * len(a) + [False] * len(filler)
        return doc[:length], answer[:length]

    def repeat_document(self, length: int) -> tuple[list[int], list[bool]]:
        """Code, a span, other code, the same span again: the second copy is predictable only by
        looking back. Induction heads, on which copying from far back builds, form fast on such data."""
        rng = self.rng
        n = rng.randint(8, max(8, length // 4))
        gaps = sorted(rng.randint(0, length - 2 * n) for _ in range(2))
        span = self.code_window(n)
        pieces = [self.code_window(g) if g else [] for g in (gaps[0], gaps[1] - gaps[0], length - 2 * n - gaps[1])]
        doc = pieces[0] + span + pieces[1] + span + pieces[2]
        first = len(pieces[0]) + n + len(pieces[1])
        mask = [first < i < first + n for i in range(length)]  # the repeat, after its first token
        return doc, mask

    def batch(self, length: int, task_share: float, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token rows [batch_size, length] and answer masks of the same shape."""
        rows, masks = [], []
        for _ in range(batch_size):
            if self.rng.random() < task_share:
                if self.rng.random() < self.repeat_share:
                    row, mask = self.repeat_document(length)
                else:
                    row, mask = self.task_document(length)
            else:
                row, mask = self.code_window(length), [False] * length
            rows.append(row)
            masks.append(mask)
        return torch.tensor(rows), torch.tensor(masks)


def _stage(frac: float, curriculum: str) -> tuple[int, float]:
    if curriculum not in CURRICULA:
        raise ValueError(f"unknown curriculum {curriculum!r}; choose from {sorted(CURRICULA)}")
    stages = CURRICULA[curriculum]
    length, share = stages[0][1], stages[0][2]
    for start, ln, sh in stages:
        if frac >= start:
            length, share = ln, sh
    return length, share


def export_hf(model: Transformer, tok_path: Path, out: Path) -> None:
    """Write a Hugging Face directory: config.json, model.safetensors, tokenizer.json, generation_config.json."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    # bf16 on disk keeps the bundled model small; loaders upcast to the dtype asked for
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "tokenizer.json").write_text(tok_path.read_text())
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id[0]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def init_weights(model: Transformer, std: float = 0.02) -> None:
    """GPT-2 style: N(0, 0.02), residual output projections scaled down by depth."""
    depth_scale = 1.0 / math.sqrt(2 * model.config.num_hidden_layers)
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue  # norms stay at 1; biases are absent in this config
        scale = depth_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
        torch.nn.init.normal_(p, mean=0.0, std=std * scale)


def prepare_data(work: Path, vocab_size: int, log) -> tuple[Path, list[int], list[int]]:
    tok_path = work / "tokenizer.json"
    if not tok_path.exists():
        log("training the tokenizer on the standard library (train split)")
        corpus.train_tokenizer(corpus.read_split(heldout=False), vocab_size).save(str(tok_path))
    cache = work / "tokens.pt"
    if not cache.exists():
        tok = Tokenizer(tok_path)
        eot = tok.token_to_id(corpus.EOT)
        streams = {}
        for name, held in (("train", False), ("heldout", True)):
            ids: list[int] = []
            for text in corpus.read_split(heldout=held):
                ids += tok.encode(text) + [eot]
            streams[name] = ids
            log(f"tokenised {name} split: {len(ids):,} tokens")
        torch.save(streams, cache)
    streams = torch.load(cache)
    return tok_path, streams["train"], streams["heldout"]


def train(tc: TrainConfig, log=print) -> Path:
    # Long: one resumable training run read top to bottom (data, model, resume, the step loop with its
    # checkpoints and evals); its parts share the run's state, and split apart they would only pass it around.
    out, work = Path(tc.out), Path(tc.out) / "work"
    work.mkdir(parents=True, exist_ok=True)
    if tc.threads:
        torch.set_num_threads(tc.threads)
    if tc.init_from and not (work / "tokenizer.json").exists():
        # a continuation keeps its starting model's tokenizer (token ids must mean the same)
        (work / "tokenizer.json").write_text((Path(tc.init_from) / "tokenizer.json").read_text())
    tok_path, train_ids, held_ids = prepare_data(work, tc.vocab_size, log)
    tok = Tokenizer(tok_path)
    eot = tok.token_to_id(corpus.EOT)
    torch.manual_seed(tc.seed)
    model = Transformer(model_config(tc, eot))
    init_weights(model)
    if tc.init_from and not (work / "ckpt.pt").exists():
        _load_weights(model, Path(tc.init_from))
        log(f"initialised from {tc.init_from}")
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=tc.lr, betas=(0.9, 0.95))
    data = DataSource(tok, train_ids, tc.seed, tc.repeat_share)
    step, elapsed = 0, 0.0
    ckpt = work / "ckpt.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        data.rng.setstate(state["data_rng"])
        torch.set_rng_state(state["torch_rng"])
        step, elapsed = state["step"], state["elapsed"]
        log(f"resumed from step {step} ({elapsed / 60:.1f} min)")
    log(f"model: {n_params / 1e6:.2f} M parameters; budget {tc.minutes} min; config {asdict(tc)}")
    budget = tc.minutes * 60
    last_ckpt, t_prev = elapsed, time.time()
    window_tokens, window_start = 0, time.time()
    while elapsed < budget:
        length, share = _stage(elapsed / budget, tc.curriculum)
        length = min(length, tc.max_len)
        batch, answer = data.batch(length + 1, share, max(1, tc.tokens_per_batch // length))
        warm = min(1.0, (step + 1) / tc.warmup_steps)
        lr = tc.lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * elapsed / budget)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch[:, :-1].reshape(-1), batch[:, 1:].reshape(-1)
        # answer tokens weigh more: they are few, and copying them is what the tasks teach
        weight = 1.0 + (tc.answer_weight - 1.0) * answer[:, 1:].reshape(-1).float()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=tc.bf16):
            logits = model(x, [0] * batch.shape[0], [length] * batch.shape[0])
        token_loss = F.cross_entropy(logits.float(), y, reduction="none")
        loss = (token_loss * weight).sum() / weight.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        now = time.time()
        elapsed += now - t_prev
        t_prev = now
        window_tokens += x.numel()
        if step % 20 == 0:
            rate = window_tokens / max(now - window_start, 1e-9)
            log(f"step {step} | {elapsed / 60:6.1f}/{tc.minutes:.0f} min | len {length} task {share:.2f} | "
                f"loss {loss.item():.3f} | lr {lr:.2e} | {rate:,.0f} tok/s")
            window_tokens, window_start = 0, now
        if elapsed - last_ckpt >= tc.checkpoint_minutes * 60 or elapsed >= budget:
            _checkpoint(model, opt, data, step, elapsed, ckpt, tok_path, out, tok, held_ids, log)
            last_ckpt = elapsed
            t_prev = window_start = time.time()  # evaluation time does not count against the budget
            window_tokens = 0
    return out


def _load_weights(model: Transformer, hf_dir: Path) -> None:
    """Copy weights from a Hugging Face directory with the same shapes (a continuation run)."""
    from vericache.model.loader import load_model

    src = load_model(hf_dir, device="cpu", dtype="float32").model
    missing = model.load_state_dict(src.state_dict(), strict=False)
    if missing.missing_keys or missing.unexpected_keys:
        raise ValueError(f"{hf_dir}: weights do not match this model config: {missing}")


def export_checkpoint(tc: TrainConfig, dest: str | Path) -> Path:
    """Export the run's latest checkpoint as a Hugging Face directory (how the bundled model is shipped)."""
    work = Path(tc.out) / "work"
    tok = Tokenizer(work / "tokenizer.json")
    model = Transformer(model_config(tc, tok.token_to_id(corpus.EOT)))
    model.load_state_dict(torch.load(work / "ckpt.pt", weights_only=False)["model"])
    export_hf(model, work / "tokenizer.json", Path(dest))
    return Path(dest)


def _checkpoint(model, opt, data, step, elapsed, ckpt, tok_path, out, tok, held_ids, log) -> None:
    tmp = ckpt.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "data_rng": data.rng.getstate(),
                "torch_rng": torch.get_rng_state(), "step": step, "elapsed": elapsed}, tmp)
    tmp.replace(ckpt)  # atomic: a kill mid-save leaves the previous checkpoint intact
    export_hf(model, tok_path, out)
    model.eval()
    metrics = {
        "step": step, "minutes": round(elapsed / 60, 2),
        "heldout_loss": round(heldout_loss(model, held_ids, window=1024, max_windows=8), 4),
        "retrieval_em_heldout_layouts": retrieval_exact_match(model, tok, held_ids, n=20, context_tokens=1536).exact_match,
        "retrieval_em_train_layouts": retrieval_exact_match(model, tok, held_ids, n=10, context_tokens=1536,
                                                            heldout=False).exact_match,
        # short contexts show a copy mechanism forming long before it reaches 1.5K tokens
        "retrieval_em_heldout_layouts_512": retrieval_exact_match(model, tok, held_ids, n=10,
                                                                  context_tokens=512).exact_match,
        "toolcall_em_heldout_layouts": toolcall_exact_match(model, tok, held_ids, n=10).exact_match,
    }
    model.train()
    with open(ckpt.parent / "curve.jsonl", "a") as f:
        f.write(json.dumps(metrics) + "\n")
    log("eval " + json.dumps(metrics))
