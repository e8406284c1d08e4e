"""``vericache bench serve --soak``: mixed traffic (streams, whole bodies, clients that hang
up, bad requests) against a server it starts itself (`vericache serve --model tiny`), over real HTTP; the suite
soaks for 20 s sampled every 2 s (the same checks as a long run's, the same code), the 15-minute run on the
real model is in docs/BENCHMARKS.md."""

from __future__ import annotations

import json

from vericache.cli import main
from vericache_lab.bench.serve import soak_verdict


def test_a_short_soak_passes_with_memory_flat(tmp_path, capsys):
    plot = tmp_path / "soak.png"
    rc = main(["bench", "serve", "--soak", "0.33", "--sample-every", "2", "--model", "tiny", "--max-tokens", "32",
               "--json", "--plot", str(plot)])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["passed"], res["failures"]
    assert res["errors_5xx"] == 0 and res["bad_not_4xx"] == 0
    assert all(res["by_kind"][k] > 0 for k in ("stream", "whole", "bad")), res["by_kind"]
    assert res["cancelled_by_client"] > 0 and res["completed"] > 0
    assert res["after"] == {"num_requests_running": 0, "kv_cache_bytes": 0}
    assert len(res["samples"]) >= 6 and all(s["rss_mb"] > 0 for s in res["samples"])   # every 2 s, and the end
    assert max(s["kv_bytes"] for s in res["samples"]) > 0                                # KV was in use meanwhile
    assert res["rss_growth_after_warmup_mb"] <= res["rss_bound_mb"]
    assert plot.stat().st_size > 10_000


def test_the_verdict_names_each_failure():
    base = {"completed": 10, "errors_5xx": 0, "bad_not_4xx": 0, "after": {"num_requests_running": 0, "kv_cache_bytes": 0},
            "samples": [{"rss_mb": m} for m in (500, 900, 910, 905, 912, 915, 911, 913, 914, 916)]}
    assert soak_verdict(dict(base), rss_bound_mb=64) == []           # the warm-up's growth does not count
    leaking = {**base, "samples": [{"rss_mb": 900 + 20 * i} for i in range(10)]}
    assert "grew 140 MB" in soak_verdict(leaking, rss_bound_mb=64)[0]
    broken = {**base, "errors_5xx": 2, "bad_not_4xx": 1, "after": {"num_requests_running": 1, "kv_cache_bytes": 4096}}
    assert len(soak_verdict(broken, rss_bound_mb=64)) == 3
    assert soak_verdict({**base, "completed": 0}, rss_bound_mb=64) == ["no request completed"]
