"""``bench serve --prompt-tokens``'s figure: the decode throughput while every request decodes, counted
from the tokens each chunk says it carries (issue 39)."""

from __future__ import annotations

from vericache_lab.bench.serve_long import Stream, decode_window


def test_the_window_counts_tokens_between_the_last_first_token_and_the_first_last_token():
    a = Stream(0.0, [(1.0, 1), (2.0, 4), (3.0, 6), (5.0, 9)])      # rounds: several tokens a chunk
    b = Stream(0.0, [(2.5, 1), (3.5, 2), (4.0, 5), (6.0, 8)])
    seconds, tokens = decode_window([a, b])
    assert seconds == 5.0 - 2.5
    assert tokens == (9 - 4) + (5 - 1)   # a: 4 tokens by 2.5, 9 by 5.0; b: 1 by 2.5, 5 by 5.0
    assert decode_window([a, Stream(0.0, [(6.0, 1), (7.0, 2)])]) == (0.0, 0)   # never all decoding at once
