"""Synthetic long-range tasks: retrieval written as code, and tool calls.

Each task is a *context* (a literal that defines many entries, or a log) and
one or more *queries* whose answers must be copied exactly from far back.
Layouts are split into a training family and a held-out family: evaluation
uses layouts the training generator never produces.

A task is returned as pieces so the trainer can splice code filler between
the context and the queries:  Task(context, queries=[(prompt, answer), ...]).
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass


@dataclass
class Task:
    context: str
    queries: list[tuple[str, str]]  # (text up to the answer, answer text incl. its terminator)


# --------------------------------------------------------------------------- names and values

_WORDS = ("alpha beta gamma delta omega cache node user port host path mode level limit size "
          "token batch layer head block page queue store shard region zone user_id order item "
          "price count index key value name label color speed timeout retry buffer window rate "
          "seed epoch stage phase owner group team account ticket invoice device sensor").split()


def _key(rng: random.Random) -> str:
    parts = [rng.choice(_WORDS) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.4:
        parts.append(str(rng.randint(0, 999)))
    style = rng.randrange(4)
    if style == 0:
        return "_".join(parts)
    if style == 1:
        return parts[0] + "".join(p.capitalize() for p in parts[1:])
    if style == 2:
        return "_".join(parts).upper()
    return "_".join(parts) + rng.choice("xyzqk")


def _value(rng: random.Random) -> str:
    """A Python literal: ints of many lengths, quoted strings, floats, hex."""
    kind = rng.randrange(6)
    if kind == 0:
        return str(rng.randint(0, 10 ** rng.randint(1, 9)))
    if kind == 1:
        alphabet = string.ascii_letters + string.digits + "-_./:"
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(3, 16)))
        q = rng.choice("'\"")
        return f"{q}{s}{q}"
    if kind == 2:
        return f"{rng.uniform(-1000, 1000):.{rng.randint(1, 5)}f}"
    if kind == 3:
        return hex(rng.getrandbits(rng.choice((16, 24, 32))))
    if kind == 4:
        return f"'{rng.choice(_WORDS)}-{rng.randint(0, 99999)}'"
    return str(-rng.randint(1, 10 ** rng.randint(1, 6)))


def _entries(rng: random.Random, n: int) -> list[tuple[str, str]]:
    keys: dict[str, str] = {}
    while len(keys) < n:
        keys.setdefault(_key(rng), _value(rng))
    return list(keys.items())


def _ident(rng: random.Random) -> str:
    return rng.choice(["CONFIG", "SETTINGS", "TABLE", "REGISTRY", "LOOKUP", "DEFAULTS", "PARAMS",
                       "MAPPING", "INDEX", "OPTIONS"]) + rng.choice(["", "_A", "_2", "_MAIN", "_V3"])


# --------------------------------------------------------------------------- retrieval layouts
# Each layout: (entries, rng) -> (context, [query prefix for key k]) where the answer is the value.

def _dict_literal(rng, entries):
    name = _ident(rng)
    body = "".join(f"    {json.dumps(k)}: {v},\n" for k, v in entries)
    return f"{name} = {{\n{body}}}\n", lambda k: f'assert {name}["{k}"] == '


def _class_attrs(rng, entries):
    name = rng.choice(["Config", "Settings", "Defaults", "Params", "Table"]) + str(rng.randint(0, 99))
    keys = [(k if k.isidentifier() else "k_" + k) for k, _ in entries]
    body = "".join(f"    {k} = {v}\n" for k, (_, v) in zip(keys, entries))
    mapping = dict(zip([k for k, _ in entries], keys))
    return f"class {name}:\n{body}\n", lambda k: f"assert {name}.{mapping[k]} == "


def _dict_call(rng, entries):
    name = _ident(rng).lower()
    keys = [(k if k.isidentifier() else "k_" + k) for k, _ in entries]
    body = "".join(f"    {k}={v},\n" for k, (_, v) in zip(keys, entries))
    mapping = dict(zip([k for k, _ in entries], keys))
    return f"{name} = dict(\n{body})\n", lambda k: f'assert {name}["{mapping[k]}"] == '


def _tuple_list(rng, entries):
    name = _ident(rng)
    body = "".join(f"    ({json.dumps(k)}, {v}),\n" for k, v in entries)
    return f"{name} = [\n{body}]\n", lambda k: f'assert dict({name})["{k}"] == '


# held out: never produced by the training generator
def _if_chain(rng, entries):
    fn = rng.choice(["lookup", "resolve", "get_value", "fetch"])
    lines = [f"def {fn}(key):\n"]
    for i, (k, v) in enumerate(entries):
        kw = "if" if i == 0 else "elif"
        lines.append(f"    {kw} key == {json.dumps(k)}:\n        return {v}\n")
    lines.append("    raise KeyError(key)\n")
    return "".join(lines) + "\n", lambda k: f'assert {fn}("{k}") == '


def _kwargs_function(rng, entries):
    fn = rng.choice(["make_config", "build", "setup"])
    keys = [(k if k.isidentifier() else "k_" + k) for k, _ in entries]
    body = "".join(f"        {k}={v},\n" for k, (_, v) in zip(keys, entries))
    mapping = dict(zip([k for k, _ in entries], keys))
    ctx = f"def {fn}():\n    return Namespace(\n{body}    )\n\ncfg = {fn}()\n"
    return ctx, lambda k: f"assert cfg.{mapping[k]} == "


def _nested_dict(rng, entries):
    name = _ident(rng)
    section = rng.choice(["server", "cache", "model", "db"])
    body = "".join(f"        {json.dumps(k)}: {v},\n" for k, v in entries)
    return (f"{name} = {{\n    {json.dumps(section)}: {{\n{body}    }},\n}}\n",
            lambda k: f'assert {name}["{section}"]["{k}"] == ')


def _item_assignments(rng, entries):
    name = _ident(rng)
    body = "".join(f"{name}[{json.dumps(k)}] = {v}\n" for k, v in entries)
    return f"{name} = {{}}\n{body}", lambda k: f'assert {name}["{k}"] == '


def _json_text(rng, entries):
    var = rng.choice(["RAW", "PAYLOAD", "DOC", "BLOB"])
    body = ",\n".join(f'  "{k}": {v}' for k, v in entries)
    data = rng.choice(["data", "doc", "obj", "parsed"])
    return (f"{var} = \"\"\"{{\n{body}\n}}\"\"\"\n{data} = json.loads({var})\n",
            lambda k: f'assert {data}["{k}"] == ')


def _get_calls(rng, entries):
    name = _ident(rng)
    body = "".join(f"    {json.dumps(k)}: {v},\n" for k, v in entries)
    return f"{name} = {{\n{body}}}\n", lambda k: f'assert {name}.get("{k}") == '


def _ini_text(rng, entries):
    section = rng.choice(["main", "general", "service", "worker"])
    body = "".join(f"{k} = {v}\n" for k, v in entries)
    parser = rng.choice(["cfg", "parser", "ini"])
    return (f'INI = """\n[{section}]\n{body}"""\n{parser} = load_ini(INI)\n',
            lambda k: f'assert {parser}["{section}"]["{k}"] == ')


TRAIN_LAYOUTS = (_dict_literal, _class_attrs, _dict_call, _tuple_list, _item_assignments, _json_text,
                 _get_calls, _ini_text)
HELDOUT_LAYOUTS = (_if_chain, _kwargs_function, _nested_dict)


def retrieval_task(rng: random.Random, n_entries: int, n_queries: int = 1, heldout: bool = False) -> Task:
    entries = _entries(rng, n_entries)
    layout = rng.choice(HELDOUT_LAYOUTS if heldout else TRAIN_LAYOUTS)
    context, query = layout(rng, entries)
    picks = rng.sample(entries, min(n_queries, len(entries)))
    return Task(context, [(query(k), v + "\n") for k, v in picks])


# --------------------------------------------------------------------------- tool calls

_TOOLS = {
    "cancel_order": ("order_id",),
    "refund_payment": ("payment_id", "amount"),
    "restart_service": ("host", "service"),
    "send_email": ("to", "subject"),
    "lookup_ticket": ("ticket_id",),
    "scale_deployment": ("deployment", "replicas"),
}
_PEOPLE = ("alice bob carol dave erin frank grace heidi ivan judy mallory niaj olivia peggy "
           "rupert sybil trent victor walter yara zoe").split()


def _arg_value(rng: random.Random, arg: str) -> str | int:
    if arg in ("amount", "replicas"):
        return rng.randint(1, 10 ** rng.randint(1, 5))
    if arg == "to":
        return f"{rng.choice(_PEOPLE)}.{rng.randint(1, 999)}@{rng.choice(['corp', 'mail', 'ex'])}.com"
    prefix = "".join(rng.choice(string.ascii_uppercase) for _ in range(rng.randint(1, 3)))
    return f"{prefix}-{rng.randint(10, 10 ** rng.randint(2, 7))}"


def _log_kv(rng, who, tool, args):
    ts = f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    fields = " ".join(f"{a}={v}" for a, v in args.items())
    return f"[{ts}] user={who} event={tool} {fields}\n"


def _log_json(rng, who, tool, args):
    return json.dumps({"user": who, "event": tool, **args}) + "\n"


def _log_csv(rng, who, tool, args):
    fields = ";".join(f"{a}:{v}" for a, v in args.items())
    return f"{rng.randint(1000, 99999)},{who},{tool},{fields}\n"


def _log_prose(rng, who, tool, args):
    said = " and ".join(f"{a} {v}" for a, v in args.items())
    return f"- {who} asked for {tool} with {said}\n"


def _log_chat(rng, who, tool, args):  # held out
    said = ", ".join(f"my {a.replace('_', ' ')} is {v}" for a, v in args.items())
    return f"{who.capitalize()}: about {tool.replace('_', ' ')}: {said}.\n"


def tool_call_task(rng: random.Random, n_events: int, heldout: bool = False) -> Task:
    fmt = _log_chat if heldout else rng.choice((_log_kv, _log_json, _log_csv, _log_prose))
    people = rng.sample(_PEOPLE, min(n_events, len(_PEOPLE)))
    tools = rng.sample(sorted(_TOOLS), rng.randint(2, len(_TOOLS)))
    header = "TOOLS = " + json.dumps([{"name": t, "parameters": list(_TOOLS[t])} for t in tools]) + "\n"
    events = []
    for who in people:
        tool = rng.choice(tools)
        events.append((who, tool, {a: _arg_value(rng, a) for a in _TOOLS[tool]}))
    log = "".join(fmt(rng, *e) for e in events)
    who, tool, args = rng.choice(events)
    prompt = f"# request: {tool.replace('_', ' ')} for {who}\nCALL {{\"name\": \"{tool}\", \"arguments\": "
    return Task(header + "# log\n" + log, [(prompt, json.dumps(args) + "}\n")])
