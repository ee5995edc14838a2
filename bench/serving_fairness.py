"""Sharing between models: model B's lone-client latency while model A is flooded (issue #53).

Two ``estimax serve`` processes of the same two models (``a`` and ``b``: copies of the tiny
ResNet export of ``bench/serving.py``, one ``--model_config_file``), both with
``--num_batch_threads=2`` and no batching: one without limits (today's default), one with
``--max_concurrent_per_model=1`` (``estimax.serving.admission``: a model holds at most one run
thread, running or queued for one). For each server, rounds interleaved between them:

* B idle: a lone client sends ``--lone_requests`` requests to ``b`` (A idle);
* B under A's flood: ``--flood_clients`` clients (each its own keep-alive connection) send
  requests to ``a`` without pause while the lone client sends ``--lone_requests`` to ``b``.

Every request is TF Serving REST ``:predict`` (JSON, one base64 JPEG). The factor is B's p50
(and p99) under the flood over B's idle p50 (p99) on the same server. The clients run on the
same machine as the servers (its cores are shared: say so when reading the figures).

    .venv/bin/python bench/serving_fairness.py [--lone_requests 60 --flood_clients 32 --rounds 2]

Writes bench/results/serving_fairness.json and bench/results/serving_fairness.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import serving as sb  # noqa: E402  (bench/serving.py: the export, the routes, the fixtures)

fx = sb.fx
RESULTS = sb.RESULTS
COMMON = ["--num_batch_threads=2", "--file_system_poll_wait_seconds=0", "--no-access_log"]
SERVERS = {"no limits": [], "--max_concurrent_per_model=1": ["--max_concurrent_per_model=1"]}


def lone(route: sb.RestJson, count: int) -> list[float]:
    """``count`` requests one after the other from one client: their latencies (s)."""
    session = route.connect()
    out = []
    try:
        for i in range(count):
            t = time.perf_counter()
            assert route.send(session, i), "a lone request failed"
            out.append(time.perf_counter() - t)
    finally:
        route.close(session)
    return out


def flooded(flood: sb.RestJson, probe: sb.RestJson, clients: int, count: int) -> dict:
    """B's lone latencies while ``clients`` clients flood A; A's answers and errors meanwhile."""
    stop = threading.Event()
    answered, errors = [0], []
    lock = threading.Lock()

    def client(k: int) -> None:
        session = flood.connect()
        i = k
        try:
            while not stop.is_set():
                try:
                    ok = flood.send(session, i)
                except Exception as e:  # noqa: BLE001 - counted
                    ok = False
                    errors.append(f"{type(e).__name__}: {e}"[:200])
                with lock:
                    answered[0] += ok
                i += clients
        finally:
            flood.close(session)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the flood's queue fills before B is measured (a ramp, not a measurement)
    start = time.perf_counter()
    latencies = lone(probe, count)
    wall = time.perf_counter() - start
    stop.set()
    for t in threads:
        t.join()
    return {"b": latencies, "a_answered_per_s": answered[0] / wall, "a_errors": len(errors)}


def summary(latencies: list[float]) -> dict[str, float]:
    ms = np.asarray(latencies) * 1000
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99))}


def run(args) -> dict:
    images = sb._tiny_images()
    results: dict = {
        "command": "python bench/serving_fairness.py " + " ".join(sys.argv[1:]),
        "cpu": sb._cpu_name(),
        "cores": os.cpu_count(),
        "load_before": open("/proc/loadavg").read().split()[:3],
        "flood_clients": args.flood_clients,
        "lone_requests": args.lone_requests,
        "rounds": args.rounds,
        "servers": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = sb._tiny_export(tmp)
        config = os.path.join(tmp, "models.config")
        entries = []
        for name in ("a", "b"):
            base = os.path.join(tmp, name)
            shutil.copytree(os.path.dirname(path), base)
            entries.append(f'config {{ name: "{name}" base_path: "{base}" }}')
        with open(config, "w") as f:
            f.write("model_config_list { " + " ".join(entries) + " }")
        with (
            fx.running_server(
                [f"--model_config_file={config}", *COMMON, *SERVERS["no limits"]]
            ) as (url0, _),
            fx.running_server(
                [f"--model_config_file={config}", *COMMON, *SERVERS["--max_concurrent_per_model=1"]]
            ) as (url1, _),
        ):
            urls = dict(zip(SERVERS, (url0, url1), strict=True))
            raw = {k: {"idle": [], "flooded": [], "a_per_s": [], "a_errors": 0} for k in SERVERS}
            for url in urls.values():  # compiled and warm before anything is timed
                lone(sb.RestJson(url, images, ("a",)), 5)
                lone(sb.RestJson(url, images, ("b",)), 5)
            for r in range(args.rounds):
                for name in list(SERVERS)[:: 1 if r % 2 == 0 else -1]:
                    url = urls[name]
                    probe = sb.RestJson(url, images, ("b",))
                    raw[name]["idle"] += lone(probe, args.lone_requests)
                    out = flooded(
                        sb.RestJson(url, images, ("a",)),
                        probe,
                        args.flood_clients,
                        args.lone_requests,
                    )
                    raw[name]["flooded"] += out["b"]
                    raw[name]["a_per_s"].append(out["a_answered_per_s"])
                    raw[name]["a_errors"] += out["a_errors"]
                    print(name, r, summary(out["b"]), flush=True)
    for name, r in raw.items():
        idle, flood = summary(r["idle"]), summary(r["flooded"])
        results["servers"][name] = {
            "flags": COMMON + SERVERS[name],
            "b_idle": idle,
            "b_flooded": flood,
            "factor_p50": flood["p50_ms"] / idle["p50_ms"],
            "factor_p99": flood["p99_ms"] / idle["p99_ms"],
            "a_answered_per_s": float(np.median(r["a_per_s"])),
            "a_errors": r["a_errors"],
        }
    results["load_after"] = open("/proc/loadavg").read().split()[:3]
    return results


def markdown(r: dict) -> str:
    lines = [
        "# Sharing between models: B's latency while A is flooded",
        "",
        f"Command: `{r['command']}`. Machine: {r['cpu']}, {r['cores']} cores, shared with other "
        f"jobs (load average {' / '.join(r['load_before'])} before, "
        f"{' / '.join(r['load_after'])} after); the clients ran on the same cores as the servers.",
        "",
        f"Two models (`a`, `b`: the tiny ResNet of `serving.py`) in one server, "
        f"`{' '.join(COMMON)}`, no batching. B: a lone client, {r['lone_requests']} requests x "
        f"{r['rounds']} rounds, alone and while {r['flood_clients']} clients flood A without "
        "pause (TF Serving REST `:predict`, one JPEG each).",
        "",
        "| server | B idle p50 / p99 (ms) | B under A's flood p50 / p99 (ms) | factor p50 / p99 "
        "| A answered/s under the flood | A errors |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in r["servers"].items():
        lines.append(
            f"| {name} | {s['b_idle']['p50_ms']:.1f} / {s['b_idle']['p99_ms']:.1f} "
            f"| {s['b_flooded']['p50_ms']:.1f} / {s['b_flooded']['p99_ms']:.1f} "
            f"| **{s['factor_p50']:.1f}x** / {s['factor_p99']:.1f}x "
            f"| {s['a_answered_per_s']:.0f} | {s['a_errors']} |"
        )
    names = list(r["servers"])
    if len(names) == 2:
        before, after = (r["servers"][n]["b_flooded"] for n in names)
        lines += [
            "",
            f"Under the flood, B's p50 {before['p50_ms']:.0f} -> {after['p50_ms']:.0f} ms "
            f"(**{before['p50_ms'] / after['p50_ms']:.1f}x** lower) and p99 "
            f"{before['p99_ms']:.0f} -> {after['p99_ms']:.0f} ms "
            f"({before['p99_ms'] / after['p99_ms']:.1f}x) with {names[1]}.",
        ]
    lines += [
        "",
        "Reading: without limits B's request waits in the run threads' queue behind every "
        "request of A's flood that arrived before it; with `--max_concurrent_per_model=1` A "
        "holds at most one of the two run threads (running or queued), so B waits behind at "
        "most one of A's runs. The factor is B's latency under the flood over its idle latency "
        "on the same server. What remains of it with the cap is the CPU, not the queue: A's "
        "32 clients, their HTTP parsing and JPEG decoding share the machine's cores with B's "
        "request (the cap bounds run threads only), on a machine whose load average was "
        "already far above its core count.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lone_requests", type=int, default=60)
    parser.add_argument("--flood_clients", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--rewrite", action="store_true", help="rewrite the .md from the .json, running nothing"
    )
    args = parser.parse_args()
    if args.rewrite:
        with open(os.path.join(RESULTS, "serving_fairness.json")) as f:
            results = json.load(f)
    else:
        results = run(args)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "serving_fairness.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(RESULTS, "serving_fairness.md"), "w") as f:
        f.write(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
