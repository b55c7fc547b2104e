#!/usr/bin/env python3
"""A closed-loop load generator for `mold serve` (Python standard library only).

K clients, each posting its next request as soon as its last one is answered, N requests in
all (or for a duration). Records every request's latency and outcome, checks that every
image is a PNG (its signature), optionally that requests with the same seed got the same
bytes, scrapes /metrics at the end, and prints and writes one JSON object: images a
minute, latency p50/p95/mean (nearest-rank percentiles, as `mold sim --requests` reports
them), errors and the wall time.

  benches/serve-load.py --url http://127.0.0.1:7680 --clients 8 --requests 32 \\
      --body '{"prompt": "a red fox in snow", "steps": 28, "width": 1024, "height": 1024}' \\
      --seeds 4 --check-same-seed --warmup 8 --out load.json

The body goes to POST /v1/generate (the native endpoint, one PNG back) unless --endpoint
says /v1/images/generations (OpenAI's: JSON with b64_json images, `n` of them).
"""

import argparse
import base64
import hashlib
import json
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def percentile(sorted_values, p):
    """Nearest rank: the smallest value at or above p percent of them (mold-sim's)."""
    if not sorted_values:
        return 0.0
    rank = max(1, -(-p * len(sorted_values) // 100))
    return sorted_values[min(int(rank), len(sorted_values)) - 1]


def one_line(text, limit=300):
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Client:
    def __init__(self, base, token, timeout):
        self.base = base.rstrip("/")
        self.token = token
        self.timeout = timeout

    def request(self, method, path, body=None):
        """(status, content type, bytes); status 0 with the reason for a transport failure."""
        status, ctype, payload, _ = self.request_timed(method, path, body)
        return status, ctype, payload

    def request_timed(self, method, path, body=None):
        """request's answer and its Server-Timing header ("" where none)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        if data is not None:
            req.add_header("content-type", "application/json")
        if self.token:
            req.add_header("authorization", "Bearer " + self.token)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return (r.status, r.headers.get("content-type", ""), r.read(),
                        r.headers.get("server-timing", ""))
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("content-type", ""), e.read(), ""
        except (urllib.error.URLError, OSError) as e:
            return 0, "", one_line(getattr(e, "reason", e)).encode(), ""


def parse_server_timing(value):
    """`name;dur=ms, …` → {name: seconds}; entries without a duration are left out."""
    out = {}
    for entry in value.split(","):
        name, _, params = entry.strip().partition(";")
        for p in params.split(";"):
            k, _, v = p.strip().partition("=")
            if k == "dur" and name:
                try:
                    out[name] = float(v) / 1e3
                except ValueError:
                    pass
    return out


def images_of(content_type, payload):
    """The images of a 200 answer: a PNG, or OpenAI's JSON {data: [{b64_json}]}."""
    if content_type.startswith("image/") or payload.startswith(PNG_SIGNATURE):
        return [payload]
    try:
        doc = json.loads(payload)
        return [base64.b64decode(d["b64_json"]) for d in doc["data"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError("answer is neither a PNG nor {data: [{b64_json}]}: %s" % one_line(e))


def error_line(status, payload):
    try:
        return one_line(json.loads(payload)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return one_line(payload.decode("utf-8", "replace"))


class Run:
    """The shared state of one closed loop."""

    def __init__(self, args, client, body, total, deadline, seed_of):
        self.args = args
        self.client = client
        self.body = body
        self.total = total
        self.deadline = deadline
        self.seed_of = seed_of
        self.lock = threading.Lock()
        self.next = 0
        self.results = []

    def take(self):
        with self.lock:
            if self.total is not None and self.next >= self.total:
                return None
            if self.deadline is not None and time.monotonic() >= self.deadline:
                return None
            i = self.next
            self.next += 1
            return i

    def client_loop(self):
        while True:
            i = self.take()
            if i is None:
                return
            body = dict(self.body)
            seed = self.seed_of(i)
            if seed is not None:
                body["seed"] = seed
            t0 = time.monotonic()
            status, ctype, payload, timing = self.client.request_timed(
                "POST", self.args.endpoint, body)
            t1 = time.monotonic()
            r = {"index": i, "seed": body.get("seed"), "start": t0, "end": t1,
                 "latency_s": t1 - t0, "status": status,
                 "server_timing_s": parse_server_timing(timing)}
            if status == 200:
                try:
                    imgs = images_of(ctype, payload)
                    r["images"] = len(imgs)
                    r["png_ok"] = sum(1 for b in imgs if b.startswith(PNG_SIGNATURE))
                    r["digests"] = [hashlib.sha256(b).hexdigest()[:16] for b in imgs]
                except ValueError as e:
                    r["status"] = -1
                    r["error"] = str(e)
            else:
                r["error"] = "HTTP %d: %s" % (status, error_line(status, payload)) if status else \
                    "no answer: %s" % payload.decode("utf-8", "replace")
            with self.lock:
                self.results.append(r)


def closed_loop(args, client, body, total, duration, seed_of):
    deadline = None if duration is None else time.monotonic() + duration
    run = Run(args, client, body, total, deadline, seed_of)
    threads = [threading.Thread(target=run.client_loop, daemon=True) for _ in range(args.clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return run.results, t0, time.monotonic()


def parse_metrics(text):
    """Prometheus text → {name{labels}: value}, comments left out."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out


def wait_healthy(client, seconds):
    end = time.monotonic() + seconds
    last = ""
    while time.monotonic() < end:
        status, _, payload = client.request("GET", "/health")
        if status == 200:
            return None
        last = "HTTP %d" % status if status else payload.decode("utf-8", "replace")
        time.sleep(0.5)
    return "no healthy answer from %s/health in %g s (last: %s)" % (client.base, seconds, last)


def summarize(args, results, t0, t1):
    ok = [r for r in results if r["status"] == 200]
    errors = [r for r in results if r["status"] != 200]
    lat = sorted(r["latency_s"] for r in ok)
    images = sum(r["images"] for r in ok)
    png_ok = sum(r["png_ok"] for r in ok)
    wall = t1 - t0
    last_end = max((r["end"] for r in results), default=t1)
    span = max(last_end - t0, 1e-9)
    same = None
    if args.check_same_seed:
        groups = {}
        for r in ok:
            groups.setdefault(r["seed"], set()).add(tuple(r["digests"]))
        repeated = {s: d for s, d in groups.items()
                    if sum(1 for r in ok if r["seed"] == s) > 1}
        differ = sorted(str(s) for s, d in repeated.items() if len(d) > 1)
        same = {"seeds_repeated": len(repeated), "seeds_differing": differ,
                "ok": not differ}
    # The server's own account of each request (Server-Timing), phase by phase: medians.
    phases = {}
    for r in ok:
        for name, sec in r.get("server_timing_s", {}).items():
            phases.setdefault(name, []).append(sec)
    server_phases = {n: round(statistics.median(v), 4) for n, v in phases.items()}
    reasons = {}
    for r in errors:
        reasons[r["error"]] = reasons.get(r["error"], 0) + 1
    return {
        "label": args.label,
        "url": args.url,
        "endpoint": args.endpoint,
        "clients": args.clients,
        "requests": len(results),
        "ok": len(ok),
        "errors": len(errors),
        "error_reasons": [{"error": e, "count": n} for e, n in sorted(reasons.items())],
        "images": images,
        "png_ok": png_ok,
        "png_bad": images - png_ok,
        "wall_s": round(wall, 4),
        "images_per_min": round(images / span * 60.0, 4) if images else 0.0,
        "latency_s": {
            "p50": round(percentile(lat, 50), 4),
            "p95": round(percentile(lat, 95), 4),
            "mean": round(statistics.fmean(lat), 4) if lat else 0.0,
            "min": round(lat[0], 4) if lat else 0.0,
            "max": round(lat[-1], 4) if lat else 0.0,
        },
        "same_seed": same,
        "server_phases_median_s": server_phases,
    }


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:7680", help="the server (default %(default)s)")
    p.add_argument("--endpoint", default="/v1/generate",
                   choices=["/v1/generate", "/v1/images/generations"])
    body = p.add_mutually_exclusive_group()
    body.add_argument("--body", help="the request body, JSON")
    body.add_argument("--body-file", help="a file holding the request body")
    p.add_argument("--clients", type=int, default=8, help="K concurrent clients (default 8)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--requests", type=int, help="N requests in all (default 32)")
    size.add_argument("--duration", type=float,
                      help="seconds to start requests for (those in flight then finish)")
    p.add_argument("--seeds", type=int, default=0,
                   help="request i gets seed SEED + i %% D (D = this; 0: the body's seed for all)")
    p.add_argument("--check-same-seed", action="store_true",
                   help="requests with the same seed must get the same bytes")
    p.add_argument("--warmup", type=int, default=0,
                   help="requests sent first (K at a time) and left out of the figures")
    p.add_argument("--warmup-steps", type=int, default=2,
                   help="denoising steps of the warm-up requests (default 2)")
    p.add_argument("--token", help="bearer token")
    p.add_argument("--token-file", help="a file holding the bearer token")
    p.add_argument("--timeout", type=float, default=1800.0, help="per request, seconds")
    p.add_argument("--wait", type=float, default=0.0,
                   help="first wait up to this many seconds for GET /health to answer 200")
    p.add_argument("--label", default="", help="a name for this run, copied into the JSON")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--fail-on-error", action="store_true",
                   help="exit 1 when a request failed, an image is not a PNG or same seeds differ")
    a = p.parse_args(argv)
    if a.clients < 1:
        p.error("--clients %d: give at least 1" % a.clients)
    if a.requests is None and a.duration is None:
        a.requests = 32
    if a.requests is not None and a.requests < 1:
        p.error("--requests %d: give at least 1" % a.requests)
    if a.duration is not None and not a.duration > 0:
        p.error("--duration %s: give a positive number of seconds" % a.duration)
    if a.seeds < 0 or a.warmup < 0 or a.warmup_steps < 1:
        p.error("--seeds and --warmup take 0 or more, --warmup-steps 1 or more")
    text = a.body
    if a.body_file:
        try:
            with open(a.body_file) as f:
                text = f.read()
        except OSError as e:
            p.error("--body-file %s: %s" % (a.body_file, e.strerror))
    try:
        a.body_json = json.loads(text) if text else {"prompt": "a red fox in snow"}
    except ValueError as e:
        p.error("--body: not JSON (%s); e.g. '{\"prompt\": \"a red fox in snow\"}'" % e)
    if not isinstance(a.body_json, dict):
        p.error("--body: give a JSON object, e.g. '{\"prompt\": \"a red fox in snow\"}'")
    if a.token_file:
        try:
            with open(a.token_file) as f:
                a.token = f.read().strip()
        except OSError as e:
            p.error("--token-file %s: %s" % (a.token_file, e.strerror))
    return a


def main(argv):
    args = parse_args(argv)
    client = Client(args.url, args.token, args.timeout)
    if args.wait > 0:
        why = wait_healthy(client, args.wait)
        if why:
            print("serve-load: " + why, file=sys.stderr)
            return 2
    base_seed = int(args.body_json.get("seed", 0) or 0)
    seed_of = (lambda i: base_seed + i % args.seeds) if args.seeds else (lambda i: None)
    warm = None
    if args.warmup:
        wbody = dict(args.body_json, steps=args.warmup_steps)
        if args.endpoint == "/v1/images/generations":
            wbody["n"] = 1
        wres, w0, w1 = closed_loop(args, client, wbody, args.warmup, None, lambda i: None)
        warm = {"requests": len(wres), "ok": sum(1 for r in wres if r["status"] == 200),
                "wall_s": round(w1 - w0, 4)}
        bad = [r["error"] for r in wres if r["status"] != 200]
        if bad:
            print("serve-load: warm-up failed: " + bad[0], file=sys.stderr)
    results, t0, t1 = closed_loop(args, client, args.body_json, args.requests, args.duration,
                                  seed_of)
    out = summarize(args, results, t0, t1)
    out["warmup"] = warm
    status, _, payload = client.request("GET", "/metrics")
    out["metrics"] = parse_metrics(payload.decode("utf-8", "replace")) if status == 200 else None
    text = json.dumps(out, indent=2, sort_keys=True)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    for e in out["error_reasons"]:
        print("serve-load: %d× %s" % (e["count"], e["error"]), file=sys.stderr)
    failed = out["errors"] or out["png_bad"] or (out["same_seed"] and not out["same_seed"]["ok"])
    return 1 if args.fail_on_error and failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
