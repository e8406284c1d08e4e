"""Long-context tasks for a real instruct model, generated from seeded sources (the interpreter's
standard library, held-out split), each with a context of ``lo``..``hi`` tokens:

- code: a function of a long source file is cut after its first body lines; the model completes it.
  Scored: the function parses (``ast.parse``) and the completion equals the full-KV one.
- needle: a ``NAME = number`` line is hidden at a random depth of a long file; asked in chat for
  the value. Scored: the first number of the answer is the hidden one.
- tool: an agent trace (earlier JSON tool calls and their long results) fills the context, then a
  new request. Scored: the answer holds a JSON call, and its arguments equal the full-KV answer's.
"""

from __future__ import annotations

import ast
import json
import random
import re
import textwrap
from dataclasses import dataclass, field

from vericache_lab.data import corpus

NEEDLE_NAMES = ("SESSION_TIMEOUT_SECONDS", "MAX_UPLOAD_BYTES", "RETRY_LIMIT", "CACHE_TTL", "WORKER_COUNT",
                "DEFAULT_PORT", "BATCH_SIZE", "QUEUE_DEPTH", "BUFFER_SIZE", "LOCK_TIMEOUT")
TOOLS_SYSTEM = (
    "You are a coding agent. To use a tool, reply with exactly one JSON object "
    '{"tool": <name>, "arguments": {...}} and nothing else. Tools: read_file(path), '
    "search_code(query, path), list_dir(path).")
DIRS = ("src", "lib", "app", "core", "utils", "server", "client", "tools")


@dataclass
class LongTask:
    kind: str                 # "code" | "needle" | "tool"
    prompt_ids: list[int]
    max_tokens: int
    answer: str = ""          # needle: the number; tool: the expected call (JSON), for reference
    head: str = ""            # code: the function text in the prompt (header + first body lines)
    meta: dict = field(default_factory=dict)


def _files() -> list[str]:
    return [t for t in corpus.read_split(heldout=True) if len(t) > 2000]


def _chat(tok, messages: list[dict]) -> list[int]:
    from vericache.chat import render_chat

    return tok.encode(render_chat(tok, messages))


def code_tasks(tok, n: int, lo: int, hi: int, seed: int = 11, max_tokens: int = 48) -> list[LongTask]:
    rng = random.Random(seed)
    cands = []
    for text in _files():
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno >= 5:
                cands.append((lines, node.lineno - 1, node.body[0].lineno + 1))
    rng.shuffle(cands)
    tasks = []
    for lines, start, cut in cands:
        head = "".join(lines[start:cut])
        before = tok.encode("".join(lines[:start]))
        want = rng.randint(lo, hi) - len(tok.encode(head))
        if len(before) < want:
            continue  # not enough code before this function for the asked context
        tasks.append(LongTask("code", before[-want:] + tok.encode(head), max_tokens, head=head))
        if len(tasks) == n:
            break
    return tasks


def _code_tokens(tok, rng: random.Random, n_tokens: int, files: list[str]) -> list[int]:
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids += tok.encode(rng.choice(files))
    return ids[:n_tokens]


def needle_tasks(tok, n: int, lo: int, hi: int, seed: int = 12, max_tokens: int = 24) -> list[LongTask]:
    rng = random.Random(seed)
    files = _files()
    tasks = []
    for _ in range(n):
        name, value = rng.choice(NEEDLE_NAMES), str(rng.randint(1000, 99999))
        body = tok.decode(_code_tokens(tok, rng, rng.randint(lo, hi) - 80, files)).splitlines(keepends=True)
        depth = rng.randint(len(body) // 10, len(body) * 9 // 10)
        body.insert(depth, f"{name} = {value}\n")
        question = f"```python\n{''.join(body)}```\nWhat is the value of {name} in the file above? Answer with the number only."
        ids = _chat(tok, [{"role": "user", "content": question}])
        tasks.append(LongTask("needle", ids, max_tokens, answer=value, meta={"depth": depth / len(body)}))
    return tasks


def _tool_call(rng: random.Random) -> dict:
    path = f"{rng.choice(DIRS)}/{rng.choice(DIRS)}_{rng.randint(1, 99)}.py"
    kind = rng.choice(("read_file", "search_code", "list_dir"))
    if kind == "search_code":
        return {"tool": kind, "arguments": {"query": f"def {rng.choice(NEEDLE_NAMES).lower()}", "path": path}}
    if kind == "list_dir":
        return {"tool": kind, "arguments": {"path": path.rsplit("/", 1)[0]}}
    return {"tool": kind, "arguments": {"path": path}}


def _request(call: dict) -> str:
    a = call["arguments"]
    if call["tool"] == "read_file":
        return f"Show me the file {a['path']}."
    if call["tool"] == "list_dir":
        return f"List the directory {a['path']}."
    return f"Search {a['path']} for '{a['query']}'."


def tool_tasks(tok, n: int, lo: int, hi: int, seed: int = 13, max_tokens: int = 32) -> list[LongTask]:
    rng = random.Random(seed)
    files = _files()
    tasks = []
    for _ in range(n):
        target = rng.randint(lo, hi)
        messages = [{"role": "system", "content": TOOLS_SYSTEM}]
        while True:  # earlier turns: a request, its call, a long tool result
            call = _tool_call(rng)
            result = tok.decode(_code_tokens(tok, rng, rng.randint(60, 220), files))
            turn = [{"role": "user", "content": _request(call)},
                    {"role": "assistant", "content": json.dumps(call)},
                    {"role": "tool", "content": result}]
            if len(_chat(tok, messages + turn)) > target - 60 and len(messages) > 4:
                break
            messages += turn
        call = _tool_call(rng)
        ids = _chat(tok, messages + [{"role": "user", "content": _request(call)}])
        tasks.append(LongTask("tool", ids, max_tokens, answer=json.dumps(call), meta={"turns": len(messages) // 3}))
    return tasks


# ---------------------------------------------------------------- scoring
def function_parses(head: str, completion: str) -> bool:
    """Does header + body + completion, cut where the function's indentation ends, parse?"""
    text = head + completion
    lines = text.splitlines()
    indent = len(lines[0]) - len(lines[0].lstrip())
    body = [lines[0]]
    for line in lines[1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break  # the function is over
        body.append(line)
    if len(body) == len(lines) and not text.endswith("\n"):
        body = body[:-1]  # the last line may be cut mid-token: judge complete lines only
    try:
        ast.parse(textwrap.dedent("\n".join(body)))
        return True
    except SyntaxError:
        return False


def first_number(text: str) -> str | None:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def parse_call(text: str) -> dict | None:
    """The first JSON object in ``text`` with a "tool" and "arguments", or None."""
    start = text.find("{")
    if start < 0:
        return None
    try:
        obj, _ = json.JSONDecoder().raw_decode(text[start:])
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) and "tool" in obj and isinstance(obj.get("arguments"), dict) else None
