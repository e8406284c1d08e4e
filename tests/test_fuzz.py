"""The gateway's API fuzzed from its own OpenAPI document (schemathesis), and its request validation as a
property (hypothesis): the real app with the real engine on `tiny`, over real HTTP on 127.0.0.1.

What must hold for anything a client can send: no 5xx, every 4xx OpenAI-shaped, every response as the
document says (status, content type, body schema), and the server healthy after, with no request left
running and no KV held. Bounded to about a minute in all (examples per operation, short generations)."""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.specs.openapi.checks import positive_data_acceptance

from test_gateway import Server

FIELDS = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stream", "stream_options", "n", "user", "vericache")


@pytest.fixture(scope="module")
def fuzzed(llm):
    s = Server(llm)
    yield s
    s.close()


@pytest.fixture(scope="module")
def operations(fuzzed) -> list:
    """The gateway's operations, read from its own document over HTTP."""
    schema = schemathesis.openapi.from_url(fuzzed.url + "/openapi.json")
    ops = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in ops} >= {"POST /v1/completions", "POST /v1/chat/completions",
                                                                 "GET /v1/models", "GET /health", "GET /metrics"}
    return ops


def short(max_tokens):
    """A valid token budget cut to 8 (tiny's context admits 65,536: a generated budget could decode for
    minutes and starve the suite); what the server must refuse (not an int, < 1, over the schema's
    bound) stays as it is."""
    from vericache_gateway.protocol import MAX_TOKENS

    ok = isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and 8 < max_tokens <= MAX_TOKENS
    return 8 if ok else max_tokens


def openai_shaped(body: dict) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)


def test_every_generated_request_gets_a_documented_answer(fuzzed, operations):
    """Schemathesis' checks (no server error, status and content type documented, body as the schema
    says) on requests generated from the document, valid ones and ones that break it; every error
    OpenAI-shaped. (Schemathesis' own pytest plugin does not run on pytest 9: the cases are drawn here.)"""
    from schemathesis import GenerationMode

    for op in operations:
        strategy = op.as_strategy(generation_mode=GenerationMode.POSITIVE) | op.as_strategy(
            generation_mode=GenerationMode.NEGATIVE)
        examples = 50 if op.method.upper() == "POST" else 10

        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=strategy)
        def check(case):
            if isinstance(case.body, dict):   # keep generations short: the fuzz is about validation, not decoding
                for field in ("max_tokens", "max_completion_tokens"):
                    if field in case.body:
                        case.body[field] = short(case.body[field])
            # a schema-valid request may still be refused with a 400 the document cannot express (a
            # prompt plus max_tokens over the context, a stop string that is empty after JSON): that
            # check is left out; everything else schemathesis checks runs
            response = case.call_and_validate(base_url=fuzzed.url, timeout=60,
                                              excluded_checks=[positive_data_acceptance])
            assert response.status_code < 500, response.text[:500]
            if response.status_code >= 400:
                assert openai_shaped(response.json()), response.text[:500]
        check()


def json_values(leaves=None):
    """Any JSON value, nested a little."""
    leaves = leaves or (st.none() | st.booleans() | st.integers(-2**80, 2**80) | st.floats(allow_nan=False)
                        | st.text(max_size=20))
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=3), max_leaves=6)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), field=st.sampled_from(FIELDS),
       value=json_values())
def test_any_json_value_in_any_field_gets_a_4xx_or_a_valid_answer(fuzzed, path, field, value):
    """A valid request with one field replaced by any JSON value: a 200 with the document's body, or a
    4xx that is OpenAI-shaped and names what is wrong. Never a 5xx, never a hang."""
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0}
    body.update({"prompt": "def f(x):\n    return"} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": "hi"}]})
    body[field] = value
    if field in ("max_tokens", "max_completion_tokens"):
        body[field] = short(value)
    r = httpx.post(fuzzed.url + path, content=json.dumps(body), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code < 500, (body, r.text[:300])
    out = r.json() if "json" in r.headers.get("content-type", "") else None
    if r.status_code >= 400:
        assert 400 <= r.status_code < 500 and openai_shaped(out), (body, r.text[:300])
    elif body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
    else:
        assert out["choices"] and isinstance(out["usage"]["completion_tokens"], int), out


def test_the_server_is_healthy_and_holds_nothing_after_the_fuzz(fuzzed):
    """Runs after the fuzz tests of this module: nothing running, no KV held, /health answers 200."""
    assert httpx.get(fuzzed.url + "/health", timeout=10).status_code == 200
    loop = fuzzed.service.engine.loop
    assert not any(not r.done for r in loop.requests)
    assert loop.device.used_blocks == 0 and loop.host.used_blocks == 0
