"""The training recipe's parts: tokenizer, task generators, a resumable training run."""

from __future__ import annotations

import random
import shutil

import torch

from vericache.model.loader import load_model
from vericache_lab.data import corpus
from vericache_lab.data.tasks import HELDOUT_LAYOUTS, TRAIN_LAYOUTS, retrieval_task, tool_call_task
from vericache_lab.train.trainer import TrainConfig, train


def test_heldout_split_is_deterministic_and_small():
    files = corpus.stdlib_files()
    held = [f for f in files if corpus.is_heldout(f)]
    assert files == sorted(files) and all("site-packages" not in f.parts for f in files)
    assert 0.005 < len(held) / len(files) < 0.05
    assert held == [f for f in corpus.stdlib_files() if corpus.is_heldout(f)]


def test_tokenizer_splits_digits_and_has_eot():
    tok = corpus.train_tokenizer(["x = 12345\nprint(x)\n" * 50, "def f():\n    return 42\n" * 50], vocab_size=300)
    ids = tok.encode("x = 98765").ids
    pieces = [tok.id_to_token(i) for i in ids]
    assert [p for p in pieces if p.strip("Ġ").isdigit()] == list("98765")
    assert tok.token_to_id(corpus.EOT) is not None


def test_tasks_are_deterministic_and_answers_are_in_context():
    a = retrieval_task(random.Random(5), 10, n_queries=3)
    b = retrieval_task(random.Random(5), 10, n_queries=3)
    assert a == b and len(a.queries) == 3
    for _, answer in a.queries:
        assert answer.strip() in a.context
    t = tool_call_task(random.Random(2), 8)
    args_text = t.queries[0][1]
    assert t.queries[0][0].endswith('"arguments": ') and args_text.endswith("}\n")


def test_heldout_layouts_never_come_from_the_training_generator():
    assert not set(TRAIN_LAYOUTS) & set(HELDOUT_LAYOUTS)
    rng = random.Random(0)
    heldout_markers = ("def lookup", "def resolve", "def get_value", "def fetch", "Namespace(", '"server": {',
                       '"cache": {', '"model": {', '"db": {')
    for _ in range(200):
        task = retrieval_task(rng, rng.randint(2, 12))
        assert not any(m in task.context for m in heldout_markers)
        assert ": about " not in tool_call_task(rng, 4).context  # the chat log format is held out


def test_training_resumes_and_exports(tmp_path, llm):
    work = tmp_path / "run" / "work"
    work.mkdir(parents=True)
    shutil.copy(llm.loaded.path / "tokenizer.json", work / "tokenizer.json")
    ids = llm.tokenizer.encode(corpus.read_split(heldout=True)[0] * 3)
    torch.save({"train": ids * 4, "heldout": ids[:3000]}, work / "tokens.pt")
    logs: list[str] = []
    cfg = dict(out=str(tmp_path / "run"), tokens_per_batch=512, hidden_size=32, layers=1, heads=2, kv_heads=1,
               intermediate_size=64, checkpoint_minutes=0.02, max_len=256)
    train(TrainConfig(minutes=0.03, **cfg), log=logs.append)
    first = torch.load(work / "ckpt.pt", weights_only=False)["step"]
    train(TrainConfig(minutes=0.06, **cfg), log=logs.append)
    assert any(line.startswith(f"resumed from step {first}") for line in logs)
    assert torch.load(work / "ckpt.pt", weights_only=False)["step"] > first
    assert (work / "curve.jsonl").read_text().count("heldout_loss") >= 2
    exported = load_model(tmp_path / "run", device="cpu", dtype="float32")
    assert exported.config.num_hidden_layers == 1


def test_training_documents_mark_exactly_what_must_be_copied(llm):
    """Repeat documents mark their second copy, task documents their answers; each marked span
    occurs earlier in the document (it can be copied), and every document fills its window."""
    from vericache_lab.train.trainer import DataSource

    code = llm.tokenizer.encode(corpus.read_split(heldout=True)[0] * 3)
    data = DataSource(llm.tokenizer, code, seed=3, repeat_share=1.0)
    for length in (64, 257):
        doc, mask = data.repeat_document(length)
        assert len(doc) == len(mask) == length
        marked = [i for i, m in enumerate(mask) if m]
        first = marked[0] - 1  # the repeat's first token is not marked: nothing points to it yet
        assert marked == list(range(first + 1, first + 1 + len(marked)))
        span = doc[first : marked[-1] + 1]
        assert any(doc[i : i + len(span)] == span for i in range(first - len(span) + 1))
    doc, mask = data.task_document(512)
    assert len(doc) == len(mask) == 512 and any(mask)
    i = mask.index(True)
    j = i + mask[i:].index(False) if False in mask[i:] else len(mask)
    answer = llm.tokenizer.decode(doc[i:j]).strip()
    assert answer and answer in llm.tokenizer.decode(doc[:i])
    rows, masks = data.batch(65, task_share=1.0, batch_size=3)
    assert rows.shape == masks.shape == (3, 65) and bool(masks.any())
