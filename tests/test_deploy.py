"""Deployment files: alert rules pass promtool, every queried metric is exported, compose is complete,
and the Triton adapter's translation is right without a server."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import system_command

ROOT = Path(__file__).resolve().parents[1]


def test_alert_rules_pass_promtool():
    r = subprocess.run([system_command("promtool"), "check", "rules", str(ROOT / "monitoring/alerts.yml")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 4 rules found" in r.stdout


def queried_metrics() -> set[str]:
    dash = json.loads((ROOT / "monitoring/grafana/dashboards/vericache.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    rules = yaml.safe_load((ROOT / "monitoring/alerts.yml").read_text())
    exprs += [r["expr"] for grp in rules["groups"] for r in grp["rules"]]
    names = set()
    for e in exprs:
        names |= set(re.findall(r"\bvericache_[a-z_]+", e))
    return names


def test_dashboard_and_rules_only_query_exported_metrics(llm):
    """Start a gateway, serve one request, scrape it: every name the dashboard and rules use is there."""
    from test_gateway import Server

    s = Server(llm)
    try:
        import httpx

        # greedy: a sampled first token may be EOS (no draft, no round), which would leave metrics unset
        httpx.post(s.url + "/v1/completions",
                   json={"model": "tiny", "prompt": "def f():\n", "max_tokens": 12, "temperature": 0}, timeout=60)
        httpx.post(s.url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=60)
        exported = set(re.findall(r"^(vericache_[a-z_]+)", httpx.get(s.url + "/metrics").text, re.MULTILINE))
    finally:
        s.close()
    missing = {n for n in queried_metrics() if n not in exported}
    assert not missing, missing
    assert len(queried_metrics()) >= 12


def test_compose_parses_and_every_path_exists():
    compose = yaml.safe_load((ROOT / "docker/compose.yaml").read_text())
    nodes = {f"redis-{n}" for n in range(1, 7)}
    remote = nodes | {"redis-cluster", "verifier-1", "verifier-2", "drafter"}
    assert set(compose["services"]) == {"triton", "gateway", "prometheus", "grafana"} | remote
    assert all(compose["services"][s]["profiles"] == ["remote"] for s in remote)
    cpu = (ROOT / "docker" / "Dockerfile.cpu").read_text()
    stages = set(re.findall(r"^FROM \S+ AS (\S+)", cpu, flags=re.M))
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)
        assert "healthcheck" in svc or name == "redis-cluster", name   # a one-shot that exits 0
        if "build" in svc:
            ctx = (ROOT / "docker" / svc["build"]["context"]).resolve()
            assert (ctx / svc["build"]["dockerfile"]).exists()
            assert svc["build"]["target"] in stages, (name, svc["build"]["target"])
        assert svc["image"].endswith(":local") or svc.get("profiles") == ["grafana"], name   # built here
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            assert (ROOT / "docker" / src).resolve().exists(), (name, src)
    gpu = yaml.safe_load((ROOT / "docker/compose.gpu.yaml").read_text())
    assert (ROOT / "docker" / gpu["services"]["triton"]["build"]["dockerfile"].removeprefix("docker/")).exists()
    for dockerfile in ("Dockerfile.triton", "Dockerfile.cpu"):
        for line in (ROOT / "docker" / dockerfile).read_text().splitlines():
            if line.startswith("COPY ") and "--from=" not in line:
                for src in line.split()[1:-1]:
                    assert (ROOT / src).exists(), (dockerfile, src)


def test_the_remote_profile_is_a_cluster_two_verifiers_and_a_drafter_using_both():
    """The remote profile as issue 55 asks: six cluster nodes, each announcing its own service name, formed
    by one command over their resolved addresses (CLUSTER MEET takes no names) with a replica each; two
    verifiers on cluster nodes; a drafter whose --verifier list names both, on the cluster too."""
    services = yaml.safe_load((ROOT / "docker/compose.yaml").read_text())["services"]
    for n in range(1, 7):
        node = services[f"redis-{n}"]
        assert node["hostname"] == f"redis-{n}" and "--cluster-enabled yes" in node["command"][-1]
        assert "--cluster-announce-hostname $$HOSTNAME" in node["command"][-1]   # $$: compose's escape of $
    create = services["redis-cluster"]["command"][-1]
    assert "getent hosts redis-$$n" in create and "--cluster-replicas 1" in create and "for n in 1 2 3 4 5 6" in create
    verifiers = [services[f"verifier-{i}"]["command"] for i in (1, 2)]
    for cmd in verifiers:
        assert cmd[cmd.index("--role") + 1] == "verifier" and cmd[cmd.index("--prefix-store") + 1].startswith("redis://redis-")
    assert services["verifier-1"]["ports"] != services["verifier-2"]["ports"]
    drafter = services["drafter"]["command"]
    named = [drafter[i + 1] for i, a in enumerate(drafter) if a == "--verifier"]
    assert named == ["grpc://verifier-1:50051", "grpc://verifier-2:50051"]
    assert drafter[drafter.index("--prefix-store") + 1].startswith("redis://redis-")


def test_prometheus_config_scrapes_gateway_and_triton():
    cfg = yaml.safe_load((ROOT / "monitoring/prometheus.yml").read_text())
    targets = {t for job in cfg["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert {"gateway:8000", "triton:8002", "verifier-1:9400", "verifier-2:9400", "drafter:8000"} <= targets


def test_triton_adapter_translates_and_validates(llm):
    from vericache.engine.engine import Engine
    from vericache.serving.service import BackgroundService
    from vericache.serving.triton_adapter import InvalidInput, TritonAdapter

    svc = BackgroundService(Engine(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.125", device_budget_gb=1))
    try:
        ad = TritonAdapter(svc)
        intake, streaming = ad.parse({"text_input": np.array([b"def f():"], dtype=object),
                                                    "max_tokens": np.array([5], dtype=np.int32),
                                                    "stop_words": np.array([b"\n\n"], dtype=object),
                                                    "random_seed": np.array([3], dtype=np.uint64),
                                                    "mode": np.array([b"full"], dtype=object),
                                                    "draft_len": np.array([0], dtype=np.int32)})
        params = intake.params
        assert intake.prompt_ids == llm.tokenizer.encode("def f():") and params.max_tokens == 5 and params.seed == 3
        assert params.stop_list == ["\n\n"] and streaming is False
        assert intake.asked.mode == "full" and intake.asked.draft_len == "auto" and intake.asked.compressor is None
        # resolved once: the mode asked for, the server's compressor, "auto" draft lengths
        assert intake.options.mode == "full" and intake.options.compressor.spec().startswith("snapkv:") and intake.options.compressor.ratio == 0.125
        assert intake.options.policy.fixed is None
        for bad, needle in [({"max_tokens": np.array([5], dtype=np.int32)}, "text_input"),
                            ({"text_input": np.array([b"x"], dtype=object), "max_tokens": np.array([0])}, "max_tokens"),
                            ({"text_input": np.array([b"x"], dtype=object), "compressor": np.array([b"zip"], dtype=object)},
                             "unknown compressor"),
                            ({"text_input": np.array([b"x"], dtype=object), "mode": np.array([b"fast"], dtype=object)},
                             "unknown mode 'fast'"),
                            ({"text_input": np.array([b"x"], dtype=object), "draft_len": np.array([-2], dtype=np.int32)},
                             "draft_len must be")]:
            with pytest.raises(InvalidInput, match=needle):
                ad.parse(bad)
        job = ad.start({"text_input": np.array([b"import os\n"], dtype=object), "max_tokens": np.array([6])})
        outs = list(ad.responses(job, cancelled=lambda: False))
        assert len(outs) == 1 and outs[0]["output_ids"].dtype == np.int32
        from vericache import SamplingParams

        assert outs[0]["text_output"][0].decode() == llm.generate("import os\n", SamplingParams(max_tokens=6))[0].text
    finally:
        svc.shutdown(drain_timeout=5)


def test_triton_adapter_streams_every_token_and_asks_about_cancellation_off_the_response_path(llm):
    """Streaming responses carry every token once (deltas queued together go out as one response); whether
    a client is gone (an IPC round trip in Triton) is asked by one ``CancelWatcher`` for all streams, each
    once a sweep, however many responses it sends; a cancelled request is aborted by the watcher (its KV
    freed) and its response iterator ends."""
    from vericache import SamplingParams
    from vericache.engine.engine import Engine
    from vericache.serving.service import BackgroundService
    from vericache.serving.triton_adapter import CancelWatcher, TritonAdapter

    svc = BackgroundService(Engine(llm.loaded, mode="vericache", compressor="snapkv:ratio=0.125", device_budget_gb=1))
    watcher = CancelWatcher(svc, every_s=0.2)
    watcher.start()
    try:
        ad = TritonAdapter(svc)
        inputs = {"text_input": np.array([b"class Stack:\n"], dtype=object), "max_tokens": np.array([40]),
                  "stream": np.array([True])}
        asked = []
        job = ad.start(inputs)
        started = time.monotonic()
        gone = watcher.watch(job, lambda: asked.append(1) or False)
        outs = list(ad.responses(job, cancelled=gone.is_set))
        watcher.forget(job)
        took = time.monotonic() - started
        ref = llm.generate("class Stack:\n", SamplingParams(max_tokens=40))[0]
        assert [t for o in outs for t in o["output_ids"].tolist()] == ref.token_ids
        assert "".join(o["text_output"][0].decode() for o in outs) == ref.text
        assert len(outs) >= 2 and len(asked) <= took / 0.2 + 1    # once a sweep, not once a response
        job = ad.start({**inputs, "max_tokens": np.array([2000]), "text_input": np.array([b"def run():\n"], dtype=object)})
        started = time.monotonic()
        gone = watcher.watch(job, lambda: time.monotonic() - started > 0.3)
        assert list(ad.responses(job, cancelled=gone.is_set)) != [] and gone.is_set()
        assert time.monotonic() - started < 5
        deadline = time.monotonic() + 10
        while svc.num_running() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert svc.num_running() == 0
        broken = ad.start({**inputs, "max_tokens": np.array([2000])})   # a sender that cannot answer: gone
        watcher.watch(broken, lambda: 1 / 0)
        assert watcher.sweep() == 1 and watcher.sweep() == 0
        deadline = time.monotonic() + 10
        while svc.num_running() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert svc.num_running() == 0
    finally:
        watcher.stop()
        svc.shutdown(drain_timeout=5)
