"""``slipstream bench front-load``: vLLM's own load generator through the sidecar's front.

One real ``vllm serve`` on this CPU (the tiny model of :mod:`slipstream_testbed.vllm`,
``--max-num-seqs 256`` and ``--dtype float32`` by default: in bfloat16 the tiny model's
nearly flat next-token distribution ties often enough that a greedy answer can change with the
batch, sidecar or not), two sidecars in front of it (their front, ``slipstream-front``,
built here from ``sidecar/front``; told the engine's sequences, block size and KV blocks as
vLLM reports them), and ``vllm bench serve``, vLLM's own client
(:mod:`slipstream_testbed.vllm.bench_serve`), all on loopback. At each concurrency (64, 128 and
256, and 512: twice the engine's sequences) the same seeded random prompts go through each
path, in rounds whose order follows a Williams design over the repeats (each path in every
position, and behind every other, equally often; the first repeat puts ``front`` before
``control``):

* ``direct``: the client talks to vLLM (both sidecars run beside it, idle);
* ``front``: the client talks to the sidecar's HTTP port (the sidecar as it ships: prompt
  lengths from vLLM's ``/tokenize``);
* ``control``: direct again, with a CPU burner beside it that uses the CPU the sidecar's
  processes (its Python process and its front) used per second of the last ``front`` round at
  that concurrency. On a host whose cores vLLM, the client and the sidecar share, part of the
  front's cost is only CPU taken from vLLM; the control's ratio to direct is that part;
* ``front_estimate``: a second sidecar, with ``--online-prompt-tokens estimate`` (bytes/4, no
  ``/tokenize`` call to vLLM per request): what the ``/tokenize`` round trip costs vLLM's API
  server, which on this CPU serves every request's HTTP as well (``--no-estimate`` leaves it
  out).

Reported per concurrency: each path's TTFT and TPOT (mean and p99), request and output-token
throughput, failures, CPU milliseconds per request of vLLM, the sidecar and the client (from
``/proc``, by process group), as the median over the repeats; each path's ratio to direct, and
whether it lies outside direct's own spread over the repeats (resolved); where the front's is
resolved, the share of its departure from direct that the control shows too; whether every
greedy answer (temperature 0) through a front is the direct one's text. Timings are printed and
written (``--json``), never asserted.

Deliberately left out: offline work (``bench colocation``), the sidecar's own time on the path
(``bench sidecar`` reads it from the front's spans), and GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slipstream_cli.argtypes import whole

SCHEMA = "slipstream.bench.front-load/v1"
PATHS = ("direct", "front", "control", "front_estimate")
FRONTS = ("front", "front_estimate")
CONCURRENCY = (64, 128, 256, 512)
ENGINE_BATCHED_TOKENS = 2048
FIGURES = (
    "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
    "request_throughput", "output_throughput",
)
GROUPS = ("vllm", "sidecar", "sidecar_estimate", "client", "burner")
EXPLAIN_FLOOR = 0.05
"""A ratio within this of 1 leaves the control nothing to explain (no share is given)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--concurrency", type=whole(1), nargs="+", default=list(CONCURRENCY),
                        help="requests in flight per round (default 64 128 256 512)")
    parser.add_argument("--max-num-seqs", type=whole(1), default=256,
                        help="vLLM's --max-num-seqs, told to the sidecar too (default 256)")
    parser.add_argument("--dtype", default="float32",
                        help="vLLM's --dtype (default float32, so greedy answers do not depend "
                        "on the batch and can be compared between paths)")
    parser.add_argument("--input-len", type=whole(1), default=64,
                        help="prompt tokens of every request (default 64)")
    parser.add_argument("--output-len", type=whole(1), default=32,
                        help="output tokens of every request, --ignore-eos (default 32)")
    parser.add_argument("--prompts-per-stream", type=whole(1), default=2,
                        help="a round sends this many prompts per concurrent stream, at least "
                        "--min-prompts (default 2)")
    parser.add_argument("--min-prompts", type=whole(1), default=256,
                        help="the fewest prompts in a round (default 256)")
    parser.add_argument("--repeats", type=whole(1), default=6,
                        help="rounds per path and concurrency (default 6)")
    parser.add_argument("--seed", type=int, default=0, help="the dataset's seed (default 0)")
    parser.add_argument("--no-control", dest="control", action="store_false",
                        help="leave out the control path (direct with the sidecar's CPU burnt "
                        "beside it)")
    parser.add_argument("--no-estimate", dest="estimate", action="store_false",
                        help="leave out the front_estimate path (a second sidecar with "
                        "--online-prompt-tokens estimate)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="keep the logs and vLLM's result files here (default: a "
                        "temporary folder, removed)")


# -- CPU ---------------------------------------------------------------------------------------


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) the live processes of process group ``pgid`` have used."""
    ticks = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def burn(share: float, period_s: float = 0.01) -> None:
    """Use ``share`` of one CPU until killed: each period, spin until this process has used
    ``share`` of the period in CPU time (or the period is over), then sleep out the rest."""
    while True:
        start, cpu = time.monotonic(), time.process_time()
        while (time.process_time() - cpu < share * period_s
               and time.monotonic() - start < period_s):
            pass
        left = period_s - (time.monotonic() - start)
        if left > 0:
            time.sleep(left)


@contextlib.contextmanager
def burner(rate: float) -> Iterator[int | None]:
    """Processes in one new process group that together use ``rate`` CPUs (one per started
    CPU, each an equal share); yields the group's id (None for a rate of 0)."""
    n = math.ceil(rate) if rate > 0 else 0
    procs: list[subprocess.Popen[bytes]] = []
    code = "from slipstream_cli.benches.front_load import burn; burn({:.6f})"
    try:
        for i in range(n):
            procs.append(subprocess.Popen(
                [sys.executable, "-c", code.format(rate / n)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                process_group=0 if i == 0 else procs[0].pid,
            ))
        time.sleep(0.5 if procs else 0)  # their imports done before the round starts
        yield procs[0].pid if procs else None
    finally:
        for p in procs:
            p.kill()
            p.wait()


# -- processes ---------------------------------------------------------------------------------


def _free_port() -> int:
    from slipstream_testbed.vllm import free_port

    return free_port()


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the sidecar exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=1) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the sidecar was not ready within {timeout_s:.0f} s")


@contextlib.contextmanager
def sidecar(engine_url: str, front: Path, *, served_name: str, max_num_seqs: int,
            block_size: int, kv_blocks: int, log: Path,
            extra: tuple[str, ...] = ()) -> Iterator[tuple[str, int]]:
    """A sidecar in front of ``engine_url`` as it ships (but for ``extra`` flags), told the
    engine's shape; yields its URL and process group."""
    from slipstream_testbed.procgroup import stop_group

    http_port, grpc_port = _free_port(), _free_port()
    args = [
        sys.executable, "-m", "slipstream_cli.main", "sidecar", "--engine", engine_url,
        "--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--model", served_name, "--max-num-seqs", str(max_num_seqs),
        "--max-num-batched-tokens", str(ENGINE_BATCHED_TOKENS),
        "--block-size", str(block_size), "--kv-blocks", str(kv_blocks),
        "--front-binary", str(front), *extra,
    ]
    with log.open("ab") as out:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{http_port}"
    try:
        _wait_ready(proc, url, log, 120)
        yield url, proc.pid
    finally:
        stop_group(proc)


# -- rounds ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Round:
    path: str
    repeat: int
    figures: dict[str, float]
    texts: tuple[str, ...]
    errors: tuple[str, ...]
    cpu_s: dict[str, float]
    wall_s: float
    burner_rate: float


def round_order(paths: tuple[str, ...], repeat: int) -> list[str]:
    """Repeat ``repeat``'s order of ``paths`` (a row of a Williams design, as ``bench
    sidecar`` orders its blocks); in the first row ``front`` comes before ``control``, whose
    burner takes its rate from the last front round."""
    from slipstream_cli.benches.sidecar import block_order

    return block_order(list(paths), repeat)


def _ratios(paths: dict[str, dict[str, Any]], name: str) -> dict[str, float]:
    return {f: paths[name]["median"][f] / paths["direct"]["median"][f] for f in FIGURES}


def resolved(ratio: dict[str, float], spread: dict[str, float]) -> dict[str, bool]:
    """Per figure, whether a path's ratio to direct lies outside direct's own spread (its
    highest repeat over its lowest, either way): a departure from 1 this run resolves."""
    return {f: not 1 / spread[f] <= ratio[f] <= spread[f] for f in FIGURES}


def _explained(front: dict[str, float], control: dict[str, float],
               spread: dict[str, float]) -> dict[str, float | None]:
    """Per figure, the share of the front's departure from direct that the control shows
    too: (control - 1) / (front - 1); None where the run does not resolve the front's
    departure (within direct's spread, or within EXPLAIN_FLOOR of 1)."""
    ok = resolved(front, spread)
    return {
        f: (control[f] - 1) / (front[f] - 1)
        if ok[f] and abs(front[f] - 1) >= EXPLAIN_FLOOR else None
        for f in FIGURES
    }


def summarise(rounds: list[Round], num_prompts: int) -> dict[str, Any]:
    """One concurrency's rounds: per path the median figures over its repeats (and each
    repeat's), CPU per request, failures; ratios to direct; what the control explains; the
    greedy answers compared with the same repeat's direct ones."""
    paths: dict[str, dict[str, Any]] = {}
    for name in PATHS:
        mine = [r for r in rounds if r.path == name]
        if not mine:
            continue
        paths[name] = {
            "median": {f: statistics.median(r.figures[f] for r in mine) for f in FIGURES},
            "per_repeat": {f: [r.figures[f] for r in mine] for f in FIGURES},
            "failed": sum(int(r.figures["failed"]) for r in mine),
            "completed": sum(int(r.figures["completed"]) for r in mine),
            "cpu_ms_per_request": {
                g: statistics.median(r.cpu_s[g] for r in mine) / num_prompts * 1e3
                for g in GROUPS
            },
            "errors": sorted({e for r in mine for e in r.errors})[:5],
        }
    direct = {r.repeat: r for r in rounds if r.path == "direct"}
    differing = {
        name: [sum(a != b for a, b in zip(r.texts, direct[r.repeat].texts, strict=True))
               for r in rounds if r.path == name]
        for name in FRONTS if name in paths
    }
    per = paths["direct"]["per_repeat"]
    out: dict[str, Any] = {
        "num_prompts": num_prompts,
        "paths": paths,
        # direct against itself: each figure's highest repeat over its lowest (this host's
        # resolution; a ratio to direct nearer 1 than this is not resolved)
        "direct_spread": {f: max(per[f]) / min(per[f]) for f in FIGURES},
        "outputs": {
            "identical": not any(n for per in differing.values() for n in per),
            "differing_per_repeat": differing,
        },
    }
    for name in ("front", "control", "front_estimate"):
        if name in paths:
            out[f"ratio_{name}"] = _ratios(paths, name)
            out[f"resolved_{name}"] = resolved(out[f"ratio_{name}"], out["direct_spread"])
            # each repeat's round against that repeat's direct round (minutes apart at most)
            out[f"ratio_{name}_per_repeat"] = {
                f: [a / d for a, d in zip(paths[name]["per_repeat"][f], per[f], strict=True)]
                for f in FIGURES
            }
    if "control" in paths:
        out["explained_by_cpu"] = _explained(out["ratio_front"], out["ratio_control"],
                                             out["direct_spread"])
        controls = [r for r in rounds if r.path == "control"]
        out["control_cpu"] = {
            "target_rate": statistics.median(r.burner_rate for r in controls),
            "burner_rate": statistics.median(r.cpu_s["burner"] / r.wall_s for r in controls),
        }
    return out


def run(args: argparse.Namespace) -> int:
    parser = argparse.ArgumentParser(prog="slipstream bench front-load")
    add_arguments(parser)
    if args.repeats < 1 or min(args.concurrency) < 1 or args.max_num_seqs < 1:
        parser.error("--repeats, --concurrency and --max-num-seqs must be >= 1")
    return run_in_work_dir(parser, args, _run, "slipstream-front-load-")


def run_in_work_dir(
    parser: argparse.ArgumentParser, args: argparse.Namespace,
    body: Callable[[argparse.Namespace, Path], int], prefix: str,
) -> int:
    """A bench on real ``vllm serve``: a usage error if there is no vLLM environment, then
    ``body`` in ``--work-dir`` (kept) or in a temporary folder (removed)."""
    from slipstream_testbed.vllm import VllmUnavailableError, vllm_python

    try:
        vllm_python()
    except VllmUnavailableError as err:
        parser.error(str(err))
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        return body(args, args.work_dir)
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        return body(args, Path(tmp))


def _run(args: argparse.Namespace, work: Path) -> int:
    from rich.console import Console

    from slipstream_testbed.gobuild import build_front
    from slipstream_testbed.vllm import VllmServer, VllmServerOptions, ensure
    from slipstream_testbed.vllm.bench_serve import BenchServeClient, RandomWorkload, cache_shape

    console = Console(width=max(Console().width, 120))
    front_bin = build_front(work)
    model = ensure()
    opts = VllmServerOptions(model_dir=model, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=ENGINE_BATCHED_TOKENS,
                             extra_args=("--dtype", args.dtype),
                             log_path=work / "vllm-serve.log")
    workload = RandomWorkload(model, input_len=args.input_len, output_len=args.output_len,
                              seed=args.seed)
    paths = tuple(p for p in PATHS if (p != "control" or args.control)
                  and (p != "front_estimate" or args.estimate))
    results: dict[str, Any] = {}
    started, load_start = time.monotonic(), loadavg()
    with contextlib.ExitStack() as stack:
        with console.status("starting vllm serve and the sidecar"):
            srv = stack.enter_context(VllmServer(opts))
            block_size, kv_blocks = cache_shape(srv.url)
            version = engine_version(srv.url)
            urls = {"direct": srv.url, "control": srv.url}
            groups = {"vllm": srv.pid}
            for name, group, extra in (
                ("front", "sidecar", ()),
                ("front_estimate", "sidecar_estimate", ("--online-prompt-tokens", "estimate")),
            ):
                if name in paths:
                    urls[name], groups[group] = stack.enter_context(sidecar(
                        srv.url, front_bin, served_name=opts.served_model_name,
                        max_num_seqs=args.max_num_seqs, block_size=block_size,
                        kv_blocks=kv_blocks, log=work / f"{group}.log", extra=extra))
            client = stack.enter_context(BenchServeClient(work / "bench-serve.log"))
            groups["client"] = client.pid

        def one(path: str, c: int, n: int, rep: int, rate: float) -> Round:
            out = work / f"{path}-{c}-{rep}.json"
            argv = workload.argv(urls[path], concurrency=c, num_prompts=n, result_file=out,
                                 label=path)
            with burner(rate) as burn_group:
                ids = {**groups, **({"burner": burn_group} if burn_group else {})}
                before = {g: group_cpu_s(p) for g, p in ids.items()}
                t0 = time.monotonic()
                res = client.run(argv, out)
                wall = time.monotonic() - t0
                cpu = {g: group_cpu_s(p) - before[g] for g, p in ids.items()}
            return Round(path, rep, res.figures(), res.generated_texts, res.errors,
                         {g: cpu.get(g, 0.0) for g in GROUPS}, wall, rate)

        first = args.concurrency[0]
        n_first = max(args.min_prompts, args.prompts_per_stream * first)
        for path in ("direct", *(p for p in FRONTS if p in paths)):
            # untimed: vLLM's import, the connections, the sidecars' first /tokenize answers
            with console.status(f"warm-up round, {path}"):
                one(path, first, n_first, -1, 0.0)
        for c in args.concurrency:
            n = max(args.min_prompts, args.prompts_per_stream * c)
            rounds: list[Round] = []
            rate = 0.0
            for rep in range(args.repeats):
                for path in round_order(paths, rep):
                    with console.status(f"{c} concurrent, repeat {rep + 1}, {path}"):
                        r = one(path, c, n, rep, rate if path == "control" else 0.0)
                    if path == "front":
                        rate = r.cpu_s["sidecar"] / r.figures["duration_s"]
                    rounds.append(r)
            results[str(c)] = summarise(rounds, n)
            _print_concurrency(console, c, results[str(c)])
    doc = {
        "schema": SCHEMA,
        "setup": {
            "vllm_version": version,
            "cpus": os.cpu_count(),
            "max_num_seqs": args.max_num_seqs,
            "dtype": args.dtype,
            "max_num_batched_tokens": ENGINE_BATCHED_TOKENS,
            "block_size": block_size,
            "kv_blocks": kv_blocks,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "prompts_per_stream": args.prompts_per_stream,
            "min_prompts": args.min_prompts,
            "repeats": args.repeats,
            "seed": args.seed,
            "paths": list(paths),
            "wall_s": time.monotonic() - started,
            "loadavg_start": load_start,
            "loadavg_end": loadavg(),
        },
        "concurrency": results,
    }
    _print_summary(console, results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0


def loadavg() -> list[float]:
    """The host's 1, 5 and 15 minute load averages (other work shares this host)."""
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def engine_version(url: str) -> str:
    with urllib.request.urlopen(url + "/version", timeout=30) as resp:
        return str(json.loads(resp.read())["version"])


def _print_concurrency(console: Any, c: int, row: dict[str, Any]) -> None:
    paths = row["paths"]
    failed = ", ".join(f"{p} {v['failed']}" for p, v in paths.items())
    console.print(
        f"{c} concurrent: failed {failed}; greedy outputs "
        f"{'identical' if row['outputs']['identical'] else 'DIFFER'}"
    )


def _print_summary(console: Any, results: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="vllm bench serve: front and control against direct (ratio of medians)")
    for col in ("concurrent", "path", "TTFT mean", "TTFT p99", "TPOT mean", "TPOT p99",
                "req/s", "tok/s"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for c, row in results.items():
        d = row["paths"]["direct"]["median"]
        table.add_row(c, "direct (ms, /s)", *(f"{d[f]:.1f}" for f in FIGURES))
        for name in ("front", "front_estimate", "control"):
            if f"ratio_{name}" in row:
                table.add_row(c, name, *(f"{row[f'ratio_{name}'][f]:.2f}x" for f in FIGURES))
        table.add_row(c, "direct spread", *(f"{v:.2f}x" for v in row["direct_spread"].values()))
        if "explained_by_cpu" in row:
            table.add_row(c, "control explains", *(
                "unresolved" if v is None else f"{v * 100:.0f} %"
                for v in row["explained_by_cpu"].values()
            ))
    console.print(table)
