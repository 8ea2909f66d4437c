"""``slipstream bench sidecar``: the latency the sidecar adds, and its highest request rate.

One run starts one engine model (``slipstream engine``) and two sidecars in front
of it (prompt lengths by ``/tokenize``, the default, and by a bytes/4 estimate;
each serves its port with its compiled front, ``slipstream-front``, built here
from ``sidecar/front`` with the local go toolchain and passed with
``--front-binary``), all as subprocesses on loopback, and drives them with an
aiohttp client:

* **added latency**: at 1, 64 and 256 concurrent streams (closed loop), the same
  requests (real Alpaca prompts from ``$SLIPSTREAM_DATA``; 16 output tokens
  each, or with ``--output-lengths alpaca`` each prompt's own answer length)
  go direct to the engine and through each sidecar, in alternating
  blocks, so all three paths see the same engine and machine load. Reported:
  TTFT and end-to-end p50/p99 of each path, the added milliseconds
  (sidecar − direct, per percentile) and the ratio sidecar/direct;
* **max_rps**: non-streaming one-token requests from 64 closed-loop clients
  for a fixed time, direct and through the default sidecar, in alternating
  slices (``--rps-slices``); the sidecar's mean rate is ``max_rps``, the direct
  rate its baseline.

The client, the engine model and the sidecar share the machine's CPUs, so the
added latency includes CPU contention; the direct path is the baseline measured
in the same run. To separate the sidecar's own cost from contention, every
block also records the CPU seconds each process spent (``/proc``), reported as
CPU milliseconds per request of the engine and of the path's sidecar;
``--pin`` gives the engine, the client and each sidecar a CPU of their own
when the host has that many (else the engine on the first CPU and the sidecars
and the client on the last; ``os.sched_setaffinity``; on a shared host this
separates them from each other, not from other work). ``--baseline-sidecar DIR`` adds one more
path, a sidecar whose package is imported from ``DIR`` first on
``PYTHONPATH`` (an older checkout's ``sidecar/``), so before/after comparisons
come from one run. The order of the paths changes from repeat to repeat
(``block_order``: a Williams design, so over its repeats each path is in
every position equally often and follows every other path equally often; a
plain rotation kept each path behind the same one every time), and
each repeat's own added TTFT (its sidecar block minus its direct block) is
kept, so the spread between repeats shows what the host can resolve. From
each sidecar that exports ``slipstream_proxy_overhead_seconds`` the bench also
reads, per block, the time requests spent in the sidecar's own code on the way
to their first token (arrival to the engine request; first chunk to the
client): a figure that excludes the process hops and engine-step alignment
that dominate the end-to-end difference on a shared host.
Every run also times a *control* path: the direct path again, in its own
blocks of the rotation (``direct_control``; ``--no-control`` leaves it out).
Its "added" latency is direct against direct, so it is zero but for the host:
its per-repeat spread is the smallest difference this run can resolve, and
the sidecar's figures are read against it (``control`` in the JSON).
``--baseline-event-loop asyncio`` runs that path on another event loop (this
checkout's code unless ``--baseline-sidecar`` says otherwise), so the event
loops are compared in one run; each sidecar's loop is read from its ready line
(``setup.event_loops``). Before the timed blocks of each concurrency, one
untimed block goes direct (every prompt the blocks send is then in the
engine's prefix cache, which the first timed block would otherwise fill alone)
and one round goes through every sidecar (their connections open).
``--reference-proxy`` adds a compiled reverse proxy (``hack/refproxy``, Go's
standard library, built with the local toolchain, nothing downloaded) as path
``proxy_reference``: it forwards and flushes and decides nothing, so its
added latency is what a proxy hop itself costs on this host (one more
process, two more sockets per token), the floor under the sidecar's figure.
``--block-warmup ROUNDS`` (default 1) runs rounds just before each timed
block: while the other paths run, a path's connections (client -> proxy ->
engine) are dropped, and without it each block's first round reopens them, so
the figures mix a burst after a lull with steady traffic. The first of those
rounds is timed on its own (``first_round`` per path: each stream's first
request after the path sat idle while the others ran, against direct's), so
that cost stays visible without landing in the steady figures; 0 gives the
old blocks, where it does.
The harness's own garbage collector is paused while a block or a rate slice is
timed (and run just before it), so a collection in the client does not land in
one path's figures.
Timings are printed and written (``--json``), never asserted.

Deliberately left out: offline work (``bench colocation`` measures SLOs under
co-location); this measures the proxy path alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from slipstream_testbed.gobuild import REFPROXY_SRC, build_front, go_build

MODEL = "llama-2-7b"
CONCURRENCY = (1, 64, 256)
OUTPUT_LENGTHS = ("fixed", "alpaca")
MAX_ALPACA_TOKENS = 512
REPO_ROOT = Path(__file__).resolve().parents[3]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument(
        "--rounds", type=int, default=3, help="requests per stream and block (default 3)"
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="alternating blocks per path (default 2)"
    )
    parser.add_argument(
        "--output-tokens",
        type=int,
        default=16,
        help="output tokens of every request with --output-lengths fixed (default 16)",
    )
    parser.add_argument(
        "--output-lengths",
        choices=OUTPUT_LENGTHS,
        default="fixed",
        help="fixed: every request asks for --output-tokens, so the streams finish in the "
        "same engine step and come back together (a proxy's worst case); alpaca: each "
        "prompt asks for its own Alpaca answer's length in the engine's tokens (at most "
        f"{MAX_ALPACA_TOKENS}), so the streams drift apart as mixed traffic does",
    )
    parser.add_argument("--rps-seconds", type=float, default=5.0)
    parser.add_argument(
        "--rps-slices", type=int, default=5, help="alternating slices of the rate test"
    )
    parser.add_argument("--gpu", default="a100")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="a CPU each for the engine, the client and every sidecar (fewer CPUs: engine "
        "on the first, the rest on the last)",
    )
    parser.add_argument(
        "--baseline-sidecar",
        type=Path,
        default=None,
        help="also run a sidecar imported from this directory (path "
        "'sidecar_baseline', tokenize mode)",
    )
    parser.add_argument(
        "--baseline-event-loop",
        choices=("auto", "uvloop", "asyncio"),
        default=None,
        help="run the 'sidecar_baseline' path on this event loop (from this checkout "
        "unless --baseline-sidecar is given); the other sidecars use 'auto'",
    )
    parser.add_argument(
        "--no-control",
        dest="control",
        action="store_false",
        help="leave out the control path (the direct path timed again in blocks of its own, "
        "whose difference from direct is this run's resolution)",
    )
    parser.add_argument(
        "--baseline-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra command-line argument of the 'sidecar_baseline' path (repeatable, "
        "e.g. --baseline-arg=--length-predictor --baseline-arg=input); it runs from this "
        "checkout unless --baseline-sidecar is given",
    )
    parser.add_argument(
        "--block-warmup",
        type=int,
        default=1,
        metavar="ROUNDS",
        help="rounds per stream just before each timed block, so no block pays for reopening "
        "the connections the client and the proxies dropped while other paths ran; the first "
        "is timed apart ('first_round': the burst after a lull) (default 1; 0: the first "
        "round of each block pays it)",
    )
    parser.add_argument(
        "--reference-proxy",
        action="store_true",
        help="also run a compiled reverse proxy (hack/refproxy, Go standard library, built "
        "here with the local go toolchain) as path 'proxy_reference': it forwards and "
        "flushes and decides nothing, so its added latency is what any proxy hop costs on "
        "this host, the floor under the sidecar's (it cuts an answer now and then: those "
        "are counted and left out of its figures; docs/benchmarks/sidecar.md)",
    )


def _data_dir() -> Path:
    return Path(os.environ.get("SLIPSTREAM_DATA", REPO_ROOT.parent / "shared" / "data"))


def _alpaca(n: int) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = json.loads(
        (_data_dir() / "prompts" / "alpaca_5000.dev.json").read_text()
    )
    return rows[:n]


def _prompts(n: int) -> list[str]:
    return [r["instruction"] + ("\n\n" + r["input"] if r["input"] else "") for r in _alpaca(n)]


async def _answer_lengths(
    session: aiohttp.ClientSession, engine: str, answers: list[str]
) -> list[int]:
    """Each answer's length in the engine's own tokens (``/tokenize``, no BOS), from 1 to
    ``MAX_ALPACA_TOKENS``."""
    out = []
    for text in answers:
        async with session.post(
            engine + "/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}
        ) as r:
            if r.status != 200:
                raise RuntimeError(f"{engine}/tokenize: {r.status} {await r.text()}")
            count = int((await r.json())["count"])
        out.append(min(max(count, 1), MAX_ALPACA_TOKENS))
    return out


REFERENCE = "proxy_reference"


def _build_refproxy(into: Path) -> Path:
    """Build the reference proxy from ``hack/refproxy`` into ``into`` (nothing downloaded)."""
    return go_build(REFPROXY_SRC, into / "refproxy")


def _start_refproxy(
    binary: Path, engine_url: str, port: int, log: Path
) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [
                str(binary),
                "--engine",
                engine_url,
                "--listen",
                f"127.0.0.1:{port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    _wait_healthy(proc, f"http://127.0.0.1:{port}", log, "refproxy")
    return proc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(
    args: list[str], url: str, log: Path, pythonpath: Path | None = None
) -> subprocess.Popen[bytes]:
    env = None
    if pythonpath is not None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(pythonpath), env.get("PYTHONPATH", "")) if p
        )
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "slipstream_cli.main", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    _wait_healthy(proc, url, log, args[0])
    return proc


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, what: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{what} did not become ready")


@dataclass
class Sample:
    ttft_s: float
    e2e_s: float


class BrokenAnswerError(RuntimeError):
    """A path cut a streamed answer short (its message names the path's URL)."""


async def _stream_one(session: aiohttp.ClientSession, url: str, body: bytes) -> Sample:
    t0 = time.perf_counter()
    ttft = None
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            if r.status != 200:
                raise RuntimeError(f"{url}: {r.status} {await r.text()}")
            async for _ in r.content.iter_any():
                if ttft is None:
                    ttft = time.perf_counter() - t0
    except aiohttp.ClientPayloadError as exc:  # say which path broke: the traceback does not
        raise BrokenAnswerError(f"{url}: {exc!r}") from exc
    except aiohttp.ClientError as exc:
        raise RuntimeError(f"{url}: {exc!r}") from exc
    e2e = time.perf_counter() - t0
    return Sample(ttft if ttft is not None else e2e, e2e)


async def _closed_loop(
    base: str,
    bodies: list[bytes],
    concurrency: int,
    per_stream: int,
    session: aiohttp.ClientSession,
    *,
    broken: list[str] | None = None,
) -> list[Sample]:
    """``concurrency`` streams of ``per_stream`` requests each. With ``broken``, an answer
    cut short is recorded there and left out of the samples; without it, it ends the run."""
    url = base + "/v1/completions"
    samples: list[Sample] = []

    async def worker(k: int) -> None:
        for j in range(per_stream):
            body = bodies[(k * per_stream + j) % len(bodies)]
            try:
                samples.append(await _stream_one(session, url, body))
            except BrokenAnswerError as exc:
                if broken is None:
                    raise
                broken.append(str(exc))

    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return samples


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Collect now, then keep this process's garbage collector off until the block ends."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


DIRECT_PATHS = frozenset(("direct", "direct_control"))
_NOT_PATHS = frozenset(("paths", "first_round"))  # a concurrency row's other keys
_METRICS = ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99")


def _against_direct(
    summ: dict[str, dict[str, Any]], blocks: dict[str, list[dict[str, Any]]], name: str
) -> dict[str, Any]:
    """Path ``name`` against the direct path of the same run: added milliseconds and
    ratios per percentile over all its blocks, and each repeat's own added TTFT (its
    block minus that repeat's direct block), whose spread says what the host resolves.
    For ``direct_control`` this is direct against direct: the run's resolution."""
    v, d = summ[name], summ["direct"]
    return (
        {f"added_{m}_ms": v[f"{m}_ms"] - d[f"{m}_ms"] for m in _METRICS}
        | {f"ratio_{m}": v[f"{m}_ms"] / d[f"{m}_ms"] for m in _METRICS}
        | {
            f"added_{m}_ms_per_repeat": [
                b[f"{m}_ms"] - bd[f"{m}_ms"]
                for b, bd in zip(blocks[name], blocks["direct"], strict=True)
            ]
            for m in ("ttft_p50", "ttft_p99")
        }
    )


def block_order(names: list[str], rep: int) -> list[str]:
    """The paths' order in repeat ``rep``: row ``rep`` (cyclically) of a Williams design.

    Over ``n`` repeats (``2n`` for an odd number ``n`` of paths) each path is in
    every position equally often and directly follows every other path equally
    often, so no path's figures always carry the same predecessor's after-effects
    (its connections, the engine's cache, the host's state).
    """
    n = len(names)
    base = [0]
    lo, hi = 1, n - 1
    while len(base) < n:  # 0, 1, n-1, 2, n-2, ...
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    rows = [[(b + i) % n for b in base] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [names[j] for j in rows[rep % len(rows)]]


def _first_round(first: dict[str, list[Sample]]) -> dict[str, dict[str, float]]:
    """Each path's first round after a lull (TTFT p50/p99 over every block's first
    request per stream) and, but for direct, its added TTFT against direct's."""
    out: dict[str, dict[str, float]] = {}
    d = _summary(first["direct"])
    for name, samples in first.items():
        v = _summary(samples)
        row = {"n": float(v["n"]), "ttft_p50_ms": v["ttft_p50_ms"], "ttft_p99_ms": v["ttft_p99_ms"]}
        if name != "direct":
            row |= {
                "added_ttft_p50_ms": v["ttft_p50_ms"] - d["ttft_p50_ms"],
                "added_ttft_p99_ms": v["ttft_p99_ms"] - d["ttft_p99_ms"],
            }
        out[name] = row
    return out


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _summary(samples: list[Sample]) -> dict[str, Any]:
    ttft = [s.ttft_s * 1e3 for s in samples]
    e2e = [s.e2e_s * 1e3 for s in samples]
    return {
        "n": len(samples),
        "ttft_p50_ms": _pct(ttft, 0.5),
        "ttft_p99_ms": _pct(ttft, 0.99),
        "e2e_p50_ms": _pct(e2e, 0.5),
        "e2e_p99_ms": _pct(e2e, 0.99),
        "ttft_mean_ms": statistics.fmean(ttft),
    }


async def _rps(
    base: str,
    seconds: float,
    clients: int,
    session: aiohttp.ClientSession,
    *,
    broken: list[str] | None = None,
) -> float:
    body = json.dumps(
        {"model": MODEL, "prompt": "Say yes.", "max_tokens": 1, "ignore_eos": True}
    ).encode()
    url = base + "/v1/completions"
    done = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            try:
                async with session.post(
                    url, data=body, headers={"Content-Type": "application/json"}
                ) as r:
                    await r.read()
                    if r.status == 200:
                        done += 1
            except aiohttp.ClientPayloadError as exc:
                if broken is None:
                    raise BrokenAnswerError(f"{url}: {exc!r}") from exc
                broken.append(f"{url}: {exc!r}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return done / (time.perf_counter() - t0)


_BUCKET = re.compile(
    r"^slipstream_proxy_overhead_seconds_(bucket|sum|count)"
    r'\{(?:le="([^"]+)",)?stage="(\w+)"\} (\S+)$',
    re.M,
)


# Online grants: all of them, and those decided inside the handler on arrival.
_GRANTS = re.compile(
    r'^slipstream_(?:requests_(admitted)_total\{class="online"\}'
    r"|online_grants_(at_arrival)_total) (\S+)$",
    re.M,
)
_GRANTS_KEY = "grants"


async def _overhead(session: aiohttp.ClientSession, base: str) -> dict[str, dict[str, float]]:
    """The sidecar's ``slipstream_proxy_overhead_seconds`` series now: {stage: {key: value}}
    (keys ``sum``, ``count`` and each bucket's ``le``); empty for a sidecar without it."""
    async with session.get(base + "/metrics") as r:
        text = await r.text()
    out: dict[str, dict[str, float]] = {}
    for kind, le, stage, value in _BUCKET.findall(text):
        out.setdefault(stage, {})[le if kind == "bucket" else kind] = float(value)
    grants = {a or b: float(v) for a, b, v in _GRANTS.findall(text)}
    if "at_arrival" in grants:
        out[_GRANTS_KEY] = grants
    return out


def _overhead_summary(
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
    into: dict[str, dict[str, float]],
) -> None:
    for stage, series in after.items():
        acc = into.setdefault(stage, {})
        for key, value in series.items():
            acc[key] = acc.get(key, 0.0) + value - before.get(stage, {}).get(key, 0.0)


def _overhead_ms(acc: dict[str, dict[str, float]]) -> dict[str, dict[str, float | None]]:
    """Mean, and the bucket bounds holding the 50th and 99th percentiles, in ms; and the
    share of online grants decided on arrival (``grants``), where the sidecar counts it."""
    out: dict[str, dict[str, float | None]] = {}
    for stage, series in acc.items():
        if stage == _GRANTS_KEY:
            adm = series.get("admitted", 0.0)
            grants: dict[str, float | None] = dict(series)
            grants["at_arrival_share"] = series["at_arrival"] / adm if adm else None
            out[stage] = grants
            continue
        n = series.get("count", 0.0)
        bounds = sorted((float(k), v) for k, v in series.items() if k not in ("sum", "count"))
        row: dict[str, float | None] = {"n": n, "mean_ms": 1e3 * series["sum"] / n if n else None}
        for q in (0.5, 0.99):
            le = next((b for b, c in bounds if n and c >= q * n), None)
            row[f"p{round(q * 100)}_le_ms"] = None if le is None else 1e3 * le
        out[stage] = row
    return out


OWN_STAGES = ("to_engine", "relay")
"""The spans that make up the sidecar's own time on the path (see ``_overhead_ms``)."""


def own_ms(
    overhead: dict[str, dict[str, float | None]] | None, q: int
) -> dict[str, float | None] | None:
    """``own_ms_p50`` / ``own_ms_p99`` of one path: per own-time span, the upper bound (ms) of
    the histogram bucket holding the ``q``-th percentile; None without spans."""
    if not overhead:
        return None
    out: dict[str, float | None] = {}
    for stage in OWN_STAGES:
        row = overhead.get(stage)
        out[stage] = None if row is None else row.get(f"p{q}_le_ms")
    return out


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) ``pid`` and its live children have used so far (a
    sidecar's compiled front is its child: its CPU is the path's too)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(_cpu_s(int(c)) for c in children)


async def _measure(
    args: argparse.Namespace, paths: dict[str, str], pids: dict[str, int]
) -> dict[str, Any]:
    prompts = _prompts(512)
    conn = aiohttp.TCPConnector(limit=0)
    results: dict[str, Any] = {"concurrency": {}}
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(600)) as s:
        if args.output_lengths == "alpaca":
            answers = [r["output"] for r in _alpaca(len(prompts))]
            lengths = await _answer_lengths(s, paths["direct"], answers)
            results["output_tokens"] = {
                "mean": statistics.fmean(lengths),
                "p50": _pct([float(n) for n in lengths], 0.5),
                "max": max(lengths),
            }
        else:
            lengths = [args.output_tokens] * len(prompts)
        bodies = [
            json.dumps(
                {
                    "model": MODEL,
                    "prompt": p,
                    "max_tokens": n,
                    "ignore_eos": True,
                    "stream": True,
                }
            ).encode()
            for p, n in zip(prompts, lengths, strict=True)
        ]
        await _closed_loop(paths["direct"], bodies, 8, 2, s)  # warm-up
        # NOTE: the reference hop has cut answers on reused engine connections (not
        # diagnosed; docs/benchmarks/sidecar.md); those are counted, not fatal. Every other
        # path's broken answer still ends the run.
        broken: dict[str, list[str]] = {REFERENCE: []}
        for name, base in paths.items():
            if name not in DIRECT_PATHS:
                await _closed_loop(base, bodies, 8, 2, s, broken=broken.get(name))
        for c in args.concurrency:
            per: dict[str, list[Sample]] = {name: [] for name in paths}
            first: dict[str, list[Sample]] = {name: [] for name in paths}
            blocks: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
            cpu: dict[str, dict[str, float]] = {n: dict.fromkeys(pids, 0.0) for n in paths}
            over: dict[str, dict[str, dict[str, float]]] = {n: {} for n in paths}
            over_blocks: dict[str, list[dict[str, dict[str, float | None]]]] = {
                n: [] for n in paths
            }
            per_stream = max(args.rounds, 40 // c)
            names = list(paths)
            # Untimed warm-up at this concurrency: one whole block direct, so every prompt
            # the blocks send is in the engine's prefix cache before the first timed block
            # (else the first path of the first repeat pays every cache miss), then one
            # request per stream on every sidecar, so no path's first block pays for
            # opening its new connections (client -> sidecar -> engine).
            await _closed_loop(paths["direct"], bodies, c, per_stream, s)
            for name in names:
                if name not in DIRECT_PATHS:
                    await _closed_loop(paths[name], bodies, c, 1, s, broken=broken.get(name))
            for rep in range(args.repeats):
                for name in block_order(names, rep):
                    if args.block_warmup:
                        # Every connection of this path (client -> proxy -> engine) open again
                        # after the other paths' blocks, as in steady traffic. The first round
                        # (the burst after a lull) is kept apart; the rest are untimed.
                        with collector_paused():
                            first[name] += await _closed_loop(
                                paths[name], bodies, c, 1, s, broken=broken.get(name)
                            )
                        if args.block_warmup > 1:
                            await _closed_loop(
                                paths[name],
                                bodies,
                                c,
                                args.block_warmup - 1,
                                s,
                                broken=broken.get(name),
                            )
                    before = {p: _cpu_s(pid) for p, pid in pids.items()}
                    o0 = await _overhead(s, paths[name]) if name not in DIRECT_PATHS else {}
                    with collector_paused():
                        got = await _closed_loop(
                            paths[name], bodies, c, per_stream, s, broken=broken.get(name)
                        )
                    for p, pid in pids.items():
                        cpu[name][p] += _cpu_s(pid) - before[p]
                    if name not in DIRECT_PATHS:
                        o1 = await _overhead(s, paths[name])
                        _overhead_summary(o0, o1, over[name])
                        block_over: dict[str, dict[str, float]] = {}
                        _overhead_summary(o0, o1, block_over)
                        over_blocks[name].append(_overhead_ms(block_over))
                    per[name] += got
                    blocks[name].append(_summary(got))
            summ: dict[str, dict[str, Any]] = {name: _summary(v) for name, v in per.items()}
            for name in paths:
                if over[name]:
                    summ[name]["overhead"] = _overhead_ms(over[name])
                    summ[name]["overhead_per_repeat"] = over_blocks[name]
            for name, v in summ.items():
                v["cpu_ms_per_request"] = {
                    p: 1e3 * t / len(per[name])
                    for p, t in cpu[name].items()
                    if p in (name, "engine")
                }
            row: dict[str, Any] = {"paths": summ}
            for name in paths:
                if name != "direct":
                    row[name] = _against_direct(summ, blocks, name)
            if args.block_warmup:
                row["first_round"] = _first_round(first)
            results["concurrency"][str(c)] = row
            for name, v in summ.items():
                reps = [
                    b.get("to_engine", {}).get("mean_ms") for b in v.get("overhead_per_repeat", [])
                ]
                if any(r is not None for r in reps):
                    print(
                        f"concurrency {c}: {name} to_engine mean per repeat, ms: "
                        + ", ".join("-" if r is None else f"{r:.2f}" for r in reps)
                        + "; added ttft p50 per repeat, ms: "
                        + ", ".join(f"{x:.1f}" for x in row[name]["added_ttft_p50_ms_per_repeat"]),
                        flush=True,
                    )
            if "direct_control" in row:
                ctl = row["direct_control"]
                print(
                    f"concurrency {c}: control (direct against direct) added ttft p50/p99 "
                    f"{ctl['added_ttft_p50_ms']:.1f}/{ctl['added_ttft_p99_ms']:.1f} ms; "
                    "p99 per repeat, ms: "
                    + ", ".join(f"{x:.1f}" for x in ctl["added_ttft_p99_ms_per_repeat"]),
                    flush=True,
                )
            if "first_round" in row:
                print(
                    f"concurrency {c}: first round after a lull, added ttft p50/p99: "
                    + ", ".join(
                        f"{n} {v['added_ttft_p50_ms']:.1f}/{v['added_ttft_p99_ms']:.1f} ms"
                        for n, v in row["first_round"].items()
                        if n != "direct"
                    ),
                    flush=True,
                )
            print(
                f"concurrency {c}: "
                + ", ".join(
                    f"{n} ttft p50/p99 {v['ttft_p50_ms']:.2f}/{v['ttft_p99_ms']:.2f} ms"
                    for n, v in summ.items()
                ),
                flush=True,
            )
        # Rates in alternating slices (in the blocks' balanced order), averaged: one path measured
        # after the other would follow the host's load of that moment.
        rps_paths = [
            n for n in ("direct", "sidecar", "sidecar_baseline", REFERENCE) if n in paths
        ]
        rates: dict[str, list[float]] = {n: [] for n in rps_paths}
        slices = max(1, args.rps_slices)
        for k in range(slices):
            for name in block_order(rps_paths, k):
                with collector_paused():
                    rate = await _rps(
                        paths[name], args.rps_seconds / slices, 64, s, broken=broken.get(name)
                    )
                rates[name].append(rate)
        results["direct_max_rps"] = statistics.fmean(rates["direct"])
        results["max_rps"] = statistics.fmean(rates["sidecar"])
        if "sidecar_baseline" in rates:
            results["baseline_max_rps"] = statistics.fmean(rates["sidecar_baseline"])
        if REFERENCE in rates:
            results["reference_max_rps"] = statistics.fmean(rates[REFERENCE])
        if REFERENCE in paths:
            results["reference_broken"] = broken[REFERENCE]
            if broken[REFERENCE]:
                print(
                    f"reference hop: {len(broken[REFERENCE])} answer(s) cut short, left out "
                    f"of its figures; first: {broken[REFERENCE][0]}",
                    flush=True,
                )
        print(
            f"max rps: sidecar {results['max_rps']:.0f}, direct {results['direct_max_rps']:.0f}",
            flush=True,
        )
    return results


def run(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="slipstream-bench-sidecar-"))
    procs: list[subprocess.Popen[bytes]] = []
    pids: dict[str, int] = {}
    loops: dict[str, str | None] = {}
    cpus = sorted(os.sched_getaffinity(0))
    baseline = (
        args.baseline_sidecar is not None
        or args.baseline_event_loop is not None
        or bool(args.baseline_arg)
    )
    hops = ["sidecar", "sidecar_estimate"] + (["sidecar_baseline"] if baseline else [])
    hops += [REFERENCE] if args.reference_proxy else []
    pinned = _pin_layout(cpus, hops)
    try:
        ep = _free_port()
        engine_url = f"http://127.0.0.1:{ep}"
        procs.append(
            _start(
                [
                    "engine",
                    "--port",
                    str(ep),
                    "--model",
                    MODEL,
                    "--gpu",
                    args.gpu,
                    "--scheduling-policy",
                    "priority",
                    "--max-num-seqs",
                    "512",
                    "--max-num-batched-tokens",
                    "8192",
                    "--kv-blocks",
                    "65536",
                    "--noise-cv",
                    "0",
                ],
                engine_url,
                tmp / "engine.log",
            )
        )
        pids["engine"] = procs[-1].pid
        paths = {"direct": engine_url}
        if args.control:
            paths["direct_control"] = engine_url
        sidecars: list[tuple[str, str, Path | None]] = [
            ("sidecar", "tokenize", None),
            ("sidecar_estimate", "estimate", None),
        ]
        if baseline:
            where = args.baseline_sidecar.resolve() if args.baseline_sidecar else None
            sidecars.append(("sidecar_baseline", "tokenize", where))
        # Every sidecar's front is built from this checkout's sidecar/front.
        front_binary = str(build_front(tmp))
        for name, mode, pythonpath in sidecars:
            extra = _baseline_flags(args) if name == "sidecar_baseline" else []
            hp = _free_port()
            url = f"http://127.0.0.1:{hp}"
            procs.append(
                _start(
                    [
                        "sidecar",
                        "--engine",
                        engine_url,
                        "--http-port",
                        str(hp),
                        "--grpc-port",
                        str(_free_port()),
                        "--max-num-seqs",
                        "512",
                        "--max-num-batched-tokens",
                        "8192",
                        "--kv-blocks",
                        "65536",
                        "--online-prompt-tokens",
                        mode,
                        "--front-binary",
                        front_binary,
                        *extra,
                    ],
                    url,
                    tmp / f"{name}.log",
                    pythonpath,
                )
            )
            paths[name] = url
            pids[name] = procs[-1].pid
            loops[name] = _ready_loop(tmp / f"{name}.log")
        if args.pin:
            os.sched_setaffinity(pids["engine"], pinned["engine"])
            os.sched_setaffinity(0, pinned["client"])
        if args.reference_proxy:
            rp = _free_port()
            procs.append(
                _start_refproxy(_build_refproxy(tmp), engine_url, rp, tmp / f"{REFERENCE}.log")
            )
            paths[REFERENCE] = f"http://127.0.0.1:{rp}"
            pids[REFERENCE] = procs[-1].pid
        if args.pin:
            for name in hops:
                os.sched_setaffinity(pids[name], pinned[name])
        results = asyncio.run(_measure(args, paths, pids))
    finally:
        if args.pin:
            os.sched_setaffinity(0, cpus)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    conc = results["concurrency"]
    out = {
        "added_ttft_p50_ms": {c: conc[c]["sidecar"]["added_ttft_p50_ms"] for c in conc},
        "added_ttft_p99_ms": {c: conc[c]["sidecar"]["added_ttft_p99_ms"] for c in conc},
        "added_e2e_p50_ms": {c: conc[c]["sidecar"]["added_e2e_p50_ms"] for c in conc},
        "added_e2e_p99_ms": {c: conc[c]["sidecar"]["added_e2e_p99_ms"] for c in conc},
        "ratio_ttft_p99": {c: conc[c]["sidecar"]["ratio_ttft_p99"] for c in conc},
        # The burst after a lull (each block's first round; None with --block-warmup 0).
        "first_round": {c: conc[c].get("first_round") for c in conc},
        "baseline": {
            "added_ttft_p50_ms": {
                c: conc[c]["sidecar_baseline"]["added_ttft_p50_ms"] for c in conc
            },
            "added_ttft_p99_ms": {
                c: conc[c]["sidecar_baseline"]["added_ttft_p99_ms"] for c in conc
            },
            "max_rps": results.get("baseline_max_rps"),
        }
        if baseline
        else None,
        "control": {
            key: {c: conc[c]["direct_control"][key] for c in conc}
            for key in ("added_ttft_p50_ms", "added_ttft_p99_ms", "added_ttft_p99_ms_per_repeat")
        }
        if args.control
        else None,
        "reference_proxy": {
            key: {c: conc[c][REFERENCE][key] for c in conc}
            for key in ("added_ttft_p50_ms", "added_ttft_p99_ms", "added_ttft_p99_ms_per_repeat")
        }
        | {
            "max_rps": results.get("reference_max_rps"),
            "broken_answers": len(results.get("reference_broken", [])),
        }
        if args.reference_proxy
        else None,
        "max_rps": results["max_rps"],
        "direct_max_rps": results["direct_max_rps"],
        "estimate_mode": {
            "added_ttft_p50_ms": {
                c: conc[c]["sidecar_estimate"]["added_ttft_p50_ms"] for c in conc
            },
            "added_ttft_p99_ms": {
                c: conc[c]["sidecar_estimate"]["added_ttft_p99_ms"] for c in conc
            },
        },
        "cpu_ms_per_request": {
            c: {name: v["cpu_ms_per_request"] for name, v in conc[c]["paths"].items()} for c in conc
        },
        "added_ttft_p99_ms_per_repeat": {
            c: conc[c]["sidecar"]["added_ttft_p99_ms_per_repeat"] for c in conc
        },
        "sidecar_overhead_ms": {c: conc[c]["paths"]["sidecar"].get("overhead") for c in conc},
        # The sidecar's own time on the path, per concurrency (the resolvable measure).
        "own_ms_p50": {c: own_ms(conc[c]["paths"]["sidecar"].get("overhead"), 50) for c in conc},
        "own_ms_p99": {c: own_ms(conc[c]["paths"]["sidecar"].get("overhead"), 99) for c in conc},
        # Every sidecar path's in-sidecar time (the baseline's too, when it exports it).
        "overhead_ms": {
            c: {
                name: v.get("overhead")
                for name, v in conc[c]["paths"].items()
                if name not in DIRECT_PATHS
            }
            for c in conc
        },
        "detail": conc,
        "setup": {
            "engine": f"{MODEL} on {args.gpu} (engine model)",
            "cpus": os.cpu_count(),
            "output_lengths": args.output_lengths,
            "output_tokens": (
                args.output_tokens if args.output_lengths == "fixed" else results["output_tokens"]
            ),
            "rounds": args.rounds,
            "repeats": args.repeats,
            "uvloop": _has_uvloop(),
            # Each sidecar's event loop, from its ready line (None: an older sidecar).
            "event_loops": loops,
            "baseline_event_loop": args.baseline_event_loop,
            "baseline_args": list(args.baseline_arg),
            "control": args.control,
            "pinned": pinned if args.pin else None,
            "baseline_sidecar": str(args.baseline_sidecar) if args.baseline_sidecar else None,
            "reference_proxy": args.reference_proxy,
            "block_warmup": args.block_warmup,
            "load_average_1m_at_end": os.getloadavg()[0],
        },
    }
    print(
        json.dumps(
            {
                k: out[k]
                for k in ("added_ttft_p50_ms", "added_ttft_p99_ms", "max_rps", "direct_max_rps")
            },
            indent=1,
        )
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
        from slipstream_cli import plots

        png = plots.added_by_repeat(
            _plot_panels(conc), args.json.with_suffix(".png"), goal_ms=1.0, control="direct_control"
        )
        print(f"wrote {args.json} and {png}")
    return 0


def _plot_panels(conc: dict[str, Any]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Per concurrency (ascending) and path (not direct itself): the added TTFT p50 and
    p99 of each repeat and of the whole run, ms, as ``plots.added_by_repeat`` takes them."""
    return {
        c: {
            name: {q: list(v[f"added_ttft_{q}_ms_per_repeat"]) for q in ("p50", "p99")}
            | {f"{q}_all": [v[f"added_ttft_{q}_ms"]] for q in ("p50", "p99")}
            for name, v in row.items()
            if name not in _NOT_PATHS
        }
        for c, row in sorted(conc.items(), key=lambda kv: int(kv[0]))
    }


def _pin_layout(cpus: list[int], names: list[str]) -> dict[str, list[int]]:
    """CPUs for ``--pin``: on a host with a core for each process (engine, client and
    every proxy in ``names``), one core each, so no path's latency includes another's
    CPU work; otherwise the engine on the first CPU and the proxies and the client on
    the last."""
    if len(cpus) >= 2 + len(names):
        layout = {"engine": [cpus[0]], "client": [cpus[1]]}
        return layout | {name: [cpus[2 + i]] for i, name in enumerate(names)}
    return {"engine": [cpus[0]], "client": [cpus[-1]]} | {name: [cpus[-1]] for name in names}


def _baseline_flags(args: argparse.Namespace) -> list[str]:
    """The extra sidecar arguments of the ``sidecar_baseline`` path."""
    flags = ["--event-loop", args.baseline_event_loop] if args.baseline_event_loop else []
    return flags + list(args.baseline_arg)


_READY_LOOP = re.compile(rb"sidecar ready http=\d+ grpc=\d+ loop=(\w+)")


def _ready_loop(log: Path, wait_s: float = 10.0) -> str | None:
    """The event loop a sidecar reported in its ready line (None: a sidecar that does not).

    The line follows the HTTP server's start (gRPC starts in between), so it may come
    shortly after ``/health`` first answers."""
    deadline = time.monotonic() + wait_s
    while True:
        text = log.read_bytes()
        m = _READY_LOOP.search(text)
        if m:
            return m.group(1).decode()
        if b"sidecar ready" in text or time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _has_uvloop() -> bool:
    try:
        import uvloop  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
    except ImportError:
        return False
    return True
