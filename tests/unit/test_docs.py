"""The docs hold together: every relative link resolves, the index reaches every page, and
the headline figures of the README, the docs index, the fleet-scale page and the benchmark
pages, in their tables and their prose, are the figures of the committed results files they
name.

A figure is checked at the rounding the page shows: "67.6 %" agrees with a share of
0.67596 and "1,583 ms" with 1.5827 s. A rerun of a benchmark that changes a headline figure
fails here until the page is brought up to date.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slipstream_cli.benches.fleet import markdown, splice

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BENCH = DOCS / "benchmarks"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
_NUMBER = re.compile(r"(?<![\w.])[-−+]?\d[\d,]*(?:\.\d+)?")


# --- markdown ---------------------------------------------------------------------------


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans."""
    return _CODE.sub("", _FENCE.sub("", text))


def _links(text: str) -> Iterator[str]:
    for m in _LINK.finditer(_prose(text)):
        yield m.group(1)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, markup and punctuation dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for m in _HEADING.finditer(_FENCE.sub("", path.read_text())):
        slug = _slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table(text: str, after: str) -> list[dict[str, str]]:
    """The first table after the first occurrence of ``after``, rows keyed by header."""
    start = text.index(after)
    lines = text[start:].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    block: list[str] = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        block.append(line)
    header = [_plain(c) for c in _cells(block[0])]
    return [dict(zip(header, _cells(line), strict=True)) for line in block[2:]]


def _plain(cell: str) -> str:
    return cell.replace("**", "").replace("`", "").strip()


def _shows(cell: str, value: float, scale: float = 1.0) -> None:
    """The first number in ``cell`` is ``value * scale`` at the precision the cell shows."""
    m = _NUMBER.search(_plain(cell))
    assert m is not None, f"no number in {cell!r}"
    text = m.group(0).replace(",", "").replace("−", "-")
    decimals = len(text.split(".")[1]) if "." in text else 0
    half = 0.5 * 10.0**-decimals
    assert abs(float(text) - value * scale) <= half + 1e-9, (
        f"{cell!r} shows {text}, the results say {value * scale:.{decimals + 2}f}"
    )


def _load(name: str) -> Any:
    return json.loads((BENCH / name).read_text())


def _after(text: str, phrase: str, count: int = 1) -> list[str]:
    """The first ``count`` numbers after ``phrase`` in ``text``'s prose: fenced blocks
    dropped, markup removed and lines joined, so a figure may sit on the next line."""
    flat = " ".join(_plain(_FENCE.sub("", text)).split())
    assert phrase in flat, f"the page no longer says {phrase!r}"
    numbers = _NUMBER.findall(flat[flat.index(phrase) + len(phrase):])
    assert len(numbers) >= count, f"fewer than {count} figures after {phrase!r}"
    return numbers[:count]


# --- links and reach --------------------------------------------------------------------


def test_the_link_checker_sees_links_and_anchors() -> None:
    text = "[a](x.md#b-c) `[no](code.md)`\n```\n[no](fence.md)\n```\n![img](p.png)"
    assert list(_links(text)) == ["x.md#b-c", "p.png"]
    assert _slug("Mooncake at 30 % busy") == "mooncake-at-30--busy"
    assert _slug("What `bench` measures: [fleet](x.md)") == "what-bench-measures-fleet"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken: list[str] = []
    for target in _links(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # an absolute URL
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_file():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor})")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_no_page_cites_a_file_outside_the_repository() -> None:
    for page in PAGES:
        assert "research/algorithms.md" not in page.read_text(), page


def test_the_index_links_every_page() -> None:
    index = DOCS / "index.md"
    linked = {
        (index.parent / t.partition("#")[0]).resolve()
        for t in _links(index.read_text())
        if not re.match(r"[a-z][a-z0-9+.-]*:", t)
    }
    missing = [
        str(p.relative_to(DOCS))
        for p in DOCS.rglob("*.md")
        if p != index and p.resolve() not in linked
    ]
    assert not missing, f"docs/index.md does not link {sorted(missing)}"


# --- headline figures -------------------------------------------------------------------


def _colocation_rows(name: str) -> dict[tuple[float, str, str], dict[str, Any]]:
    """(target busy, policy, mode) -> row, ``share`` added as a share of offline-only."""
    out: dict[tuple[float, str, str], dict[str, Any]] = {}
    for load in _load(name)["loads"]:
        rows = load["rows"]
        offline_only = next(r for r in rows if r["policy"] == "offline-only")
        for r in rows:
            share = r["offline_tokens_per_s"] / offline_only["offline_tokens_per_s"]
            out[load["target_busy"], r["policy"], r["mode"]] = {**r, "share": share}
    return out


_BUSY = {"15 %": 0.15, "30 %": 0.3, "50 %": 0.5}


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_first_screen_colocation_figures(page: str) -> None:
    rows = _colocation_rows("colocation-vllm.json")
    table = _table((ROOT / page).read_text(), "| online load (GPU busy) |")
    assert [_plain(r["online load (GPU busy)"]) for r in table] == list(_BUSY)
    for r in table:
        busy = _BUSY[_plain(r["online load (GPU busy)"])]
        plugin, sidecar = rows[busy, "budget", "plugin"], rows[busy, "budget", "sidecar"]
        naive = rows[busy, "naive", "sidecar"]
        assert plugin["slo_met"] and sidecar["slo_met"] and not naive["slo_met"]
        assert "broken" in r["no budget"]
        _shows(r["engine mode (plugin)"], plugin["share"], 100)
        _shows(r["sidecar mode"], sidecar["share"], 100)
        _shows(r["no budget"], naive["share"], 100)


def test_readme_headline_results() -> None:
    text = (ROOT / "README.md").read_text()
    table = _table(text, "| result | engine that produced it | page |")
    cells = {_plain(r["page"]).split("]")[0].lstrip("["): r["result"] for r in table}

    summary = _ordering_summary("ordering-vllm.json")
    fcfs, gittins = summary[0.9, "fcfs", "-"], summary[0.9, "gittins-r200", "memory"]
    numbers = _NUMBER.findall(cells["ordering"])
    _shows(numbers[0], 1 - gittins["mean_ttlt_s"] / fcfs["mean_ttlt_s"], 100)
    _shows(numbers[2], gittins["ttft_p99_s"] / fcfs["ttft_p99_s"])

    rows = _load("prefix.json")["rows"]
    prefix = {(r["kv_blocks"], r["order"]): r["offline_tokens_per_s"] for r in rows}
    numbers = _NUMBER.findall(cells["prefix"])
    _shows(numbers[1], prefix[1500, "psm"] / prefix[1500, "fcfs"])
    _shows(numbers[2], prefix[6499, "psm"] / prefix[6499, "fcfs"])

    own = _load("sidecar.json")["own_ms_p99"]
    worst = max(v for s in ("64", "256") for v in own[s].values())
    assert worst <= float(_NUMBER.findall(cells["sidecar"])[0])

    fleet = _load("fleet.json")
    numbers = _NUMBER.findall(cells["fleet"])
    _shows(numbers[0], fleet["nodes"])
    _shows(numbers[1], fleet["status_lag_p99_s"])
    _shows(numbers[2], fleet["operator_cpu_cores"])

    for name in ("fidelity.json", "fidelity-vllm-0.33.json"):
        report = _load(name)
        assert report["vllm_version"] in cells["fidelity"]
        assert all(s["identical_step_share"] == 1.0 for s in report["scenarios"])
        assert f"{len(report['scenarios'])} of {len(report['scenarios'])}" in cells["fidelity"]


def test_colocation_page_figures() -> None:
    text = (BENCH / "colocation.md").read_text()
    vllm, model = _colocation_rows("colocation-vllm.json"), _colocation_rows("colocation.json")
    for r in _table(text, "## Summary"):
        busy = _BUSY[_plain(r["online load (GPU busy)"])]
        for column, rows, mode in (
            ("engine mode, vLLM", vllm, "plugin"),
            ("sidecar, vLLM", vllm, "sidecar"),
            ("engine mode, engine model", model, "in-engine"),
            ("sidecar, engine model", model, "sidecar"),
        ):
            assert rows[busy, "budget", mode]["slo_met"]
            _shows(r[column], rows[busy, "budget", mode]["share"], 100)
        load = next(x for x in _load("colocation.json")["loads"] if x["target_busy"] == busy)
        _shows(r["idle-time ceiling"], 1 - load["online_only_busy_fraction"], 100)

    for r in _table(text, "## Results: vLLM's scheduler in-process"):
        busy = _BUSY[_plain(r["busy"])]
        row = vllm[busy, _plain(r["policy"]), _plain(r["mode"])]
        _shows(r["TTFT p99"], row["ttft_p99_s"], 1000)
        _shows(r["TBT p99"], row["tbt_p99_s"], 1000)
        _shows(r["offline tok/s"], row["offline_tokens_per_s"])
        if row["policy"] != "online-only":
            _shows(r["of offline-only"], row["share"], 100)
            assert ("broken" in r["of offline-only"]) == (row["slo_met"] is False)

    for busy, after in (
        (0.3, "30 % busy (limits"),
        (0.15, "15 % busy (limits"),
        (0.5, "50 % busy (limits"),
    ):
        for r in _table(text, after):
            row = model[busy, _plain(r["policy"]), _plain(r["mode"])]
            _shows(r["offline tok/s"], row["offline_tokens_per_s"])
            if row["policy"] == "offline-only":
                continue
            _shows(r["TTFT p99"], row["ttft_p99_s"], 1000)
            _shows(r["TBT p99"], row["tbt_p99_s"], 1000)
            assert _plain(r["SLO"]) == ("met" if row["slo_met"] else "broken")
            if row["policy"] != "online-only":
                _shows(r["% of offline-only"], row["share"], 100)
            if row["budget_s"] is not None:
                _shows(r["knob"], row["budget_s"], 1000)

    tolerance = _load("colocation-tolerance.json")
    for r in _table(text, "## How much tolerance buys 85 %"):
        pct = int(_NUMBER.findall(r["tolerance"])[0])
        row = next(
            x
            for x in tolerance["rows"]
            if x["tolerance_pct"] == pct and x["mode"] == _plain(r["mode"])
        )
        assert row["slo_met"] and _plain(r["SLO"]) == "met"
        _shows(r["TBT p99 ms (limit)"], row["tbt_p99_s"], 1000)
        _shows(r["budget ms"], row["budget_s"], 1000)
        _shows(r["offline tok/s"], row["offline_tokens_per_s"])
        _shows(r["% of offline-only"], row["offline_share"], 100)
    assert tolerance["goal"] == 0.85 and "85 %" in text

    mooncake = _colocation_rows("colocation-vllm-mooncake.json")
    for r in _table(text, "## Mooncake at 30 % busy"):
        row = mooncake[0.3, _plain(r["policy"]), _plain(r["mode"])]
        _shows(r["offline tok/s"], row["offline_tokens_per_s"])
        if row["policy"] not in ("online-only", "offline-only"):
            _shows(r["of offline-only"], row["share"], 100)
            assert ("broken" in r["of offline-only"]) == (row["slo_met"] is False)


def test_colocation_async_figures() -> None:
    text = (BENCH / "colocation.md").read_text()
    sync = _colocation_rows("colocation.json")
    overlapped = _colocation_rows("colocation-async.json")
    doc = _load("colocation-async.json")
    assert doc["async_scheduling"] and not _load("colocation.json").get("async_scheduling")
    step, per_seq = doc["plugin_overhead_us"]["step"], doc["plugin_overhead_us"]["per_seq"]
    assert [float(x) for x in _after(text, "--plugin-overhead-us", 2)] == [step, per_seq]
    table = _table(text, "## Async scheduling")
    assert table
    for r in table:
        key = (_BUSY[_plain(r["busy"])], _plain(r["policy"]), _plain(r["mode"]))
        before, after = sync[key], overlapped[key]
        assert _plain(r["SLO, async"]) == ("met" if after["slo_met"] else "broken")
        _shows(r["TBT p99, sync"], before["tbt_p99_s"], 1000)
        _shows(r["TBT p99, async"], after["tbt_p99_s"], 1000)
        _shows(r["offline tok/s, sync"], before["offline_tokens_per_s"])
        _shows(r["offline tok/s, async"], after["offline_tokens_per_s"])
        _shows(r["% of offline-only, async"], after["share"], 100)


def _ordering_summary(name: str) -> dict[tuple[float, str, str], dict[str, Any]]:
    return {(s["load"], s["ordering"], s["cost"]): s for s in _load(name)["summary"]}


def test_ordering_page_figures() -> None:
    text = (BENCH / "ordering.md").read_text()
    sidecar = (BENCH / "ordering-sidecar.md").read_text()
    for page, after, name in (
        (text, "### Results, Poisson arrivals", "ordering-vllm.json"),
        (text, "### Bursty arrivals", "ordering-vllm-azure.json"),
        (text, "### Results (`ordering-vllm-guard.json`", "ordering-vllm-guard.json"),
        (sidecar, "## Results (`ordering.json`", "ordering.json"),
    ):
        summary = _ordering_summary(name)
        table = _table(page, after)
        assert len(table) == len(summary), after
        for r in table:
            key = (float(_plain(r["load"])), _plain(r["ordering"]), _plain(r["cost"]))
            s = summary[key]
            _shows(r["mean TTLT"], s["mean_ttlt_s"])
            _shows(r["p99 TTLT"], s["p99_ttlt_s"])
            _shows(r["p99 TTFT"], s["ttft_p99_s"])
    sweep = {s["ordering"]: s for s in _load("ordering-vllm-guard-sweep.json")["summary"]}
    table = _table(text, "### The deadline swept at load 0.9")
    assert len(table) == len(sweep)
    for r in table:
        s = sweep[_plain(r["ordering"])]
        _shows(r["mean TTLT"], s["mean_ttlt_s"])
        _shows(r["p99 TTFT"], s["ttft_p99_s"])
        _shows(r["max wait"], s["max_wait_s"])
        if _plain(r["ordering"]) != "fcfs":
            _shows(r["vs FCFS"], s["mean_ttlt_s"] / sweep["fcfs"]["mean_ttlt_s"] - 1, 100)
    summary = _ordering_summary("ordering-vllm.json")
    for r in _table(text, "Against FCFS, with the memory cost:"):
        load = float(_plain(r["load"]))
        fcfs = summary[load, "fcfs", "-"]["mean_ttlt_s"]
        for column, ordering in (
            ("Gittins (r200)", "gittins-r200"),
            ("Gittins (np)", "gittins-np"),
            ("TRAIL-like", "trail"),
            ("SJF", "sjf"),
        ):
            _shows(r[column], summary[load, ordering, "memory"]["mean_ttlt_s"] / fcfs - 1, 100)


def test_sidecar_page_figures() -> None:
    report = _load("sidecar.json")
    text = (BENCH / "sidecar.md").read_text()
    setup = report["setup"]
    assert f"{setup['rounds']} rounds, {setup['repeats']} repeats" in text
    for r in _table(text, "**The sidecar's own time on the path**"):
        streams = _plain(r["streams"])
        for span in ("to_engine", "relay"):
            _shows(r[f"{span} p50"], report["own_ms_p50"][streams][span])
            _shows(r[f"{span} p99"], report["own_ms_p99"][streams][span])
    paths = {
        "direct": "direct",
        "control (direct again)": "direct_control",
        "sidecar": "sidecar",
        "reference hop": "proxy_reference",
    }
    for r in _table(text, "**TTFT, ms**"):
        detail = report["detail"][_plain(r["streams"])]
        for column, path in paths.items():
            p50, p99 = r[column].split("/")
            stats = detail["paths"][path]
            _shows(p50, stats["ttft_p50_ms"])
            _shows(p99, stats["ttft_p99_ms"])
    for r in _table(text, "**Added TTFT p99 against direct**"):
        streams = _plain(r["streams"])
        _shows(r["sidecar"], report["added_ttft_p99_ms"][streams])
        _shows(r["reference hop"], report["reference_proxy"]["added_ttft_p99_ms"][streams])
        low, high = _NUMBER.findall(r["control, per repeat"].replace("−", "-"))
        repeats = report["control"]["added_ttft_p99_ms_per_repeat"][streams]
        _shows(low, min(repeats))
        _shows(high, max(repeats))


_FRONT_LOAD_FIGURES = {
    "TTFT mean": "mean_ttft_ms",
    "TTFT p99": "p99_ttft_ms",
    "TPOT mean": "mean_tpot_ms",
    "TPOT p99": "p99_tpot_ms",
    "output tok/s": "output_throughput",
}
_FRONT_LOAD_PATHS = ("direct", "front", "control", "front_estimate")


def test_front_load_page_figures() -> None:
    report = _load("front-load.json")
    text = (BENCH / "front-load.md").read_text()
    rows = report["concurrency"]
    assert f"{report['setup']['wall_s']:.0f} s" in text
    for r in _table(text, "**Failures and greedy answers**"):
        row = rows[_plain(r["concurrent"])]
        paths = row["paths"]
        _shows(r["prompts per round"], row["num_prompts"])
        _shows(r["requests per path"], paths["direct"]["completed"] + paths["direct"]["failed"])
        failed = r["failed (direct / front / control / front_estimate)"].split("/")
        assert [int(x) for x in failed] == [paths[p]["failed"] for p in _FRONT_LOAD_PATHS]
        differing = row["outputs"]["differing_per_repeat"]
        cell = r["greedy answers unlike direct's (front / front_estimate)"]
        assert [int(x) for x in cell.split("/")] == [
            sum(differing["front"]), sum(differing["front_estimate"])]
    for r in _table(text, "**Direct** (ms, output tokens/s)"):
        row, path = rows[_plain(r["concurrent"])], _plain(r["path"])
        values = {
            "direct": row["paths"]["direct"]["median"],
            "direct spread": row["direct_spread"],
        }.get(path) or row[f"ratio_{path}"]
        for column, key in _FRONT_LOAD_FIGURES.items():
            _shows(r[column], values[key])
    # "No latency or throughput ratio is resolved": none lies outside direct's spread.
    assert not any(ok for row in rows.values() for name in ("front", "control", "front_estimate")
                   for ok in row[f"resolved_{name}"].values())
    own = {"front": "sidecar", "front_estimate": "sidecar_estimate"}
    for r in _table(text, "**CPU per request**, ms"):
        path = _plain(r["path"])
        cpu = rows[_plain(r["concurrent"])]["paths"][path]["cpu_ms_per_request"]
        for column, group in (("vLLM", "vllm"), ("sidecar", own.get(path, "sidecar")),
                              ("client", "client"), ("burner", "burner")):
            _shows(r[column], cpu[group])


def test_core_page_figures() -> None:
    report = _load("core.json")
    for r in _table((BENCH / "core.md").read_text(), "| key | what |"):
        key = _plain(r["key"])
        value = (
            report["extra"][key.removeprefix("extra.")] if key.startswith("extra.") else report[key]
        )
        _shows(r["this run µs"], value)


def test_budget_search_page_figures() -> None:
    report = _load("budget-search.json")
    rows = {(r["offline"], r["rate_factor"], r["slos"]): r for r in report["rows"]}
    table = _table((BENCH / "budget-search.md").read_text(), "## Results")
    assert len(table) == len(rows)
    for r in table:
        row = rows[_plain(r["backlog"]), float(r["rate factor"].split()[0]), _plain(r["SLOs"])]
        for column, key in (("analytic", "analytic"), ("simulated", "simulated")):
            cell = next(v for k, v in r.items() if k.startswith(f"{column}:"))
            budget, _, work = (c.strip() for c in cell.split(","))
            _shows(budget, row[key]["budget_s"], 1000)
            _shows(work, row[key]["offline_work_tok_s"])
            assert ("met" in cell) == row[key]["met"]


def test_prefix_page_figures() -> None:
    rows = {(r["kv_blocks"], r["order"]): r for r in _load("prefix.json")["rows"]}
    for r in _table((BENCH / "prefix.md").read_text(), "## Results"):
        row = rows[int(_plain(r["KV blocks"]).replace(",", "")), _plain(r["order"]).lower()]
        _shows(r["tokens/s"], row["offline_tokens_per_s"])
        _shows(r["prefix hit rate"], row["prefix_hit_rate"])
        _shows(r["makespan"], row["makespan_s"])


def test_fidelity_page_figures() -> None:
    text = (BENCH / "fidelity.md").read_text()
    for after, name in (
        ("## Results", "fidelity.json"),
        ("Against vLLM 0.33.0 every scenario", "fidelity-vllm-0.33.json"),
    ):
        scenarios = {s["scenario"]: s for s in _load(name)["scenarios"]}
        for r in _table(text, after):
            s = scenarios[_plain(r["scenario"])]
            _shows(r["identical_step_share"], s["identical_step_share"])
            model, vllm = (int(x) for x in _NUMBER.findall(r["preemptions (model / vLLM)"]))
            assert (model, vllm) == (s["preemptions"]["model"], s["preemptions"]["vllm"])


def test_fleet_page_results_block_is_the_benchs() -> None:
    page = (BENCH / "fleet.md").read_text()
    assert splice(page, markdown(_load("fleet.json"))) == page


def _fleet_run() -> dict[str, Any]:
    return next(s for s in _load("fleet.json")["scales"] if s["nodes"] == 1000)


def test_fleet_page_figures() -> None:
    """The headline table and the prose around it, above the generated results block."""
    run, sim = _fleet_run(), _load("fleet.json")["sim"]
    text = (BENCH / "fleet.md").read_text()

    rows = {_plain(r[""]): r for r in _table(text, "| | measured | goal | against the goal |")}
    for label, value in (
        ("status lag p99", run["status_lag_p99_s"]),
        ("operator CPU, steady (budget-search worker included)", run["steady"]["cpu_cores"]),
    ):
        _shows(rows[label]["measured"], value)
        goal = float(_NUMBER.findall(rows[label]["goal"])[0])
        _shows(rows[label]["against the goal"], value / goal)
    _shows(rows["operator CPU, ramp"]["measured"], run["ramp"]["cpu_cores"])
    rss, peak = _NUMBER.findall(rows["operator RSS (peak)"]["measured"])
    _shows(rss, run["operator_rss_mb"])
    _shows(peak, run["operator_peak_rss_mb"])
    _shows(rows["operator API requests/s, steady"]["measured"], run["steady"]["api_rps"])
    ready, running = _NUMBER.findall(rows["apply to ready (all pods Running)"]["measured"])
    _shows(ready, run["ready_s"])
    _shows(running, run["pods_running_s"])

    bumps = run["status_lag_bumps"]
    figures = _after(text, "Per bump, lag p50 / p99 / max in s:", 3 * len(bumps))
    for i, bump in enumerate(bumps):
        for shown, key in zip(figures[3 * i : 3 * i + 3], ("p50_s", "p99_s", "max_s"), strict=True):
            _shows(shown, bump[key])
    assert run["status_lag_timeouts"] == 0
    _shows(_after(text, "no service timed out (")[0], run["status_lag_samples"])
    _shows(_after(text, "wrote them (lag p99 as read")[0], bumps[0]["p99_arrival_s"])

    _shows(_after(text, "event-loop lag p99 was")[0], run["operator_loop_lag"]["p99_s"])
    gc = run["operator_gc"]
    total, young, middle = _after(text, "its garbage collector took", 3)
    _shows(total, sum(g["cores"] for g in gc.values()))
    _shows(young, gc["0"]["cores"])
    _shows(middle, gc["1"]["cores"])
    assert gc["2"]["cores"] == 0 and "no full collection" in text
    services, jobs, calls = _after(text, "Status writes are only the changes:", 3)
    _shows(services, run["status_writes_rps"]["InferenceService"])
    _shows(jobs, run["status_writes_rps"]["OfflineJob"])
    _shows(calls, run["sidecar_status_rps"]["calls"])

    cpu, top = run["control_plane_cpu_cores"], run["apiserver_top_rps"]
    _shows(_after(text, "The API server took")[0], cpu["kube-apiserver"])
    p50, p99 = _after(text, "status PATCH latency was", 2)
    _shows(p50, run["apiserver_latency"]["PATCH inferenceservices/status"]["p50_s"])
    _shows(p99, run["apiserver_latency"]["PATCH inferenceservices/status"]["p99_s"])
    assert max(top, key=top.get) == "PUT leases"
    _shows(_after(text, "PUT leases")[0], top["PUT leases"])
    _shows(_after(text, "then PATCH inferenceservices/status")[0],
           top["PATCH inferenceservices/status"])
    pods, standin, etcd, manager, kwok = _after(text, "The stand-in for", 5)
    _shows(pods, run["pods"])
    _shows(standin, run["standin_cpu_cores"])
    _shows(etcd, cpu["etcd"])
    _shows(manager, cpu["kube-controller-manager"])
    _shows(kwok, cpu["kwok"])

    rate, total, engines, horizon, fewest, most = _after(text, "is rate-scaled to", 6)
    _shows(rate, sim["online_rate_per_engine"])
    _shows(total, sim["online_rate_per_engine"] * sim["engines"])
    _shows(engines, sim["engines"])
    _shows(horizon, sim["horizon_s"])
    decisions = sim["decisions"]
    _shows(fewest, decisions[0]["engines"])
    _shows(most, decisions[-1]["engines"])
    _shows(_after(text, "5-shot prompts (")[0], sim["offline_requests"])
    _shows(_after(text, "cut into")[0], sim["shards"])
    per_request = [d["decision_us_per_request"] for d in decisions]
    low, high = _after(text, "The fleet decisions cost", 2)
    _shows(low, min(per_request))
    _shows(high, max(per_request))
    small, large, first, last = _after(text, "grow linearly with the engine count (", 4)
    _shows(small, decisions[0]["engines"])
    _shows(large, decisions[-1]["engines"])
    _shows(first, per_request[0])
    _shows(last, per_request[-1])
    variants = {(v["router"], v["placement"]): v for v in sim["variants"]}
    smart, base = variants["least-work", "spare"], variants["round-robin", "even"]
    shown_smart, shown_base, ratio = _after(text, "gave an online TTFT p99 of", 3)
    _shows(shown_smart, smart["ttft_p99_s"])
    _shows(shown_base, base["ttft_p99_s"])
    _shows(ratio, smart["ttft_p99_s"] / base["ttft_p99_s"])
    assert smart["offline_finished"] == base["offline_finished"] == sim["offline_requests"]


def test_scale_page_figures() -> None:
    """docs/scale.md repeats the 1,000-node run of benchmarks/fleet.md."""
    run, sim = _fleet_run(), _load("fleet.json")["sim"]
    text = (DOCS / "scale.md").read_text()

    lag, share, cores, ready = _after(text, "the operator meets both: status lag p99", 4)
    _shows(lag, run["status_lag_p99_s"])
    _shows(share, run["status_lag_p99_s"] / 10)
    _shows(cores, run["steady"]["cpu_cores"])
    _shows(ready, run["ready_s"])

    cpu = run["control_plane_cpu_cores"]
    for r in _table(text, "| process | CPU cores |"):
        process = _plain(r["process"])
        value = {
            "operator (with its budget-search worker)": run["steady"]["cpu_cores"],
            "stand-in for 2,000 sidecars": run["standin_cpu_cores"],
        }.get(process)
        _shows(r["CPU cores"], cpu[process] if value is None else value)

    _shows(_after(text, "event-loop lag p99 was")[0], run["operator_loop_lag"]["p99_s"])
    _shows(_after(text, "its garbage collector took")[0],
           sum(g["cores"] for g in run["operator_gc"].values()))
    api, services, jobs = _after(text, "It made", 3)
    _shows(api, run["steady"]["api_rps"])
    _shows(services, run["status_writes_rps"]["InferenceService"])
    _shows(jobs, run["status_writes_rps"]["OfflineJob"])
    _shows(_after(text, "applies) and")[0], run["sidecar_status_rps"]["calls"])
    latency = run["apiserver_latency"]["PATCH inferenceservices/status"]
    p50, p99 = _after(text, "status PATCH latency was", 2)
    _shows(p50, latency["p50_s"])
    _shows(p99, latency["p99_s"])
    _shows(_after(text, "PUT leases")[0], run["apiserver_top_rps"]["PUT leases"])
    _shows(_after(text, "Memory grows with pods:")[0], run["operator_rss_mb"])
    _shows(_after(text, "1,000 nodes (peak")[0], run["operator_peak_rss_mb"])
    figures = _after(text, "is the slowest bump (p99", 3)
    for shown, bump in zip(figures, run["status_lag_bumps"], strict=True):
        _shows(shown, bump["p99_s"])
    decisions = sim["decisions"]
    first, small, last, large = _after(text, "number of engines (", 4)
    _shows(first, decisions[0]["decision_us_per_request"])
    _shows(small, decisions[0]["engines"])
    _shows(last, decisions[-1]["decision_us_per_request"])
    _shows(large, decisions[-1]["engines"])


def test_plugin_overhead_page_figures() -> None:
    rows = {(r["workload"], r["running"], r["config"]): r
            for r in _load("plugin-overhead.json")["rows"]}
    table = _table((BENCH / "plugin-overhead.md").read_text(), "## Results")
    assert len(table) == len(rows)
    for r in table:
        row = rows[(r["workload"], int(r["running"]), _plain(r["plugin config"]))]
        _shows(r["arrivals / step"], row["arrivals_per_step"])
        _shows(r["online only"], 100 * row["online_only_share"])
        _shows(r["stock µs"], row["stock_median_us"])
        _shows(r["plugin µs"], row["plugin_median_us"])
        _shows(r["added µs"], row["added_median_us"])
        _shows(r["ratio"], row["ratio"])


def test_learning_page_figures() -> None:
    doc = _load("learning.json")
    page = (BENCH / "learning.md").read_text()
    curve = {(src["source"], p["steps"]): (src, p) for src in doc["sources"] for p in src["curve"]}
    table = _table(page, "## Results")
    assert len(table) == len(curve)
    for r in table:
        src, p = curve[(_plain(r["source"]), int(r["steps seen"]))]
        assert int(r["rows fitted"]) == p["rows"] and _plain(r["features"]) == p["feature_set"]
        _shows(r["fit ms"], 1000 * p["fit_s"])
        _shows(r["learned MAPE"], 100 * p["mape"])
        _shows(r["shipped x calibration MAPE"], 100 * src["baseline"]["mape"])
        _shows(r["noise floor"], 100 * src["noise_floor"]["mape"])
    cost = {c["running"]: c for c in doc["recording"]}
    rec = _table(page, "| scheduled requests")
    assert len(rec) == len(cost)
    for r in rec:
        c = cost[int(r["scheduled requests"])]
        _shows(r["µs per step, same batch"], c["us_per_step"])
        _shows(r["µs per step, changing batch"], c["us_per_step_changing"])


_LENGTH_SCORES = {
    "global": ("global", "-"),
    "input length": ("input_length", "-"),
    "semantic, MiniLM, nearest": ("semantic (nearest top-up)", "minilm"),
    "semantic, hashing, nearest": ("semantic (nearest top-up)", "hashing"),
}
_LENGTH_FAMILIES = {
    "global": "global",
    "input length": "input_length",
    "prefix, prior top-up": "semantic (prior top-up)",
    "prefix, nearest top-up": "semantic (nearest top-up)",
}
_LENGTH_TIMINGS = {
    "predict, compact (nearest top-up)": "predict (nearest top-up)",
    "predict, full scan (nearest top-up)": "predict (nearest top-up, full scan)",
    "embed one prompt": "embed (1 prompt)",
}
_VLLM_ORDERINGS = {
    "sjf, memory": ("sjf", "memory"),
    "gittins (no displacement), memory": ("gittins-np", "memory"),
    "gittins (r200), memory": ("gittins-r200", "memory"),
    "gittins (no displacement), output": ("gittins-np", "output"),
    "gittins (r200), output": ("gittins-r200", "output"),
}


def test_length_predictor_page_figures() -> None:
    report = _load("length_predictor.json")
    text = (BENCH / "length-predictor.md").read_text()

    scores = {(s["scope"], s["predictor"], s["embedder"]): s for s in report["scores"]}
    families = {(f["trace"], f["regime"], f["predictor"]): f for f in report["families"]}
    seen: set[tuple[str, str, str]] = set()
    for r in _table(text, "### Per regime"):
        regime, predictor = _plain(r["regime"]), _plain(r["predictor"])
        if regime.startswith("AlpacaEval"):
            scope = regime.rsplit(", ", 1)[1]
            s = scores[(scope, *_LENGTH_SCORES[predictor])]
            base = scores[scope, "global", "-"]
            assert all(r[c] == "–" for c in ("mean TTLT / global", "oracle / global", "recovered"))
        else:
            trace, kind = regime.removeprefix("Mooncake ").split(", ")
            key = (f"mooncake-{trace}", kind, _LENGTH_FAMILIES[predictor])
            s, base = families[key], families[(*key[:2], "global")]
            seen.add(key)
            ratio, oracle = s["mean_ttlt_ratio_vs_global"], s["oracle_ttlt_ratio_vs_global"]
            _shows(r["mean TTLT / global"], ratio)
            _shows(r["oracle / global"], oracle)
            _shows(r["recovered"], (1 - ratio) / (1 - oracle), 100)
        assert int(r["queries"]) == s["queries"]
        _shows(r["P(true bucket)"], s["p_bucket"])
        _shows(r["vs global"], s["p_bucket"] / base["p_bucket"])
    # The page names what it leaves out: the "all" rows and the prior top-up on unique.
    assert seen == {
        k for k in families if k[1] != "all" and k[1:] != ("unique", "semantic (prior top-up)")
    }

    def family(trace: str, regime: str, predictor: str = "semantic (nearest top-up)") -> Any:
        return families[f"mooncake-{trace}", regime, predictor]

    def gain(row: Any) -> float:
        trace = row["trace"].removeprefix("mooncake-")
        return float(row["p_bucket"] / family(trace, row["regime"], "global")["p_bucket"])

    conversation, synthetic = family("conversation", "recurring"), family("synthetic", "recurring")
    _shows(_after(text, "requests that continue a known prefix get")[0], gain(conversation))
    cut, recovered, oracle = _after(text, "Gittins on those samples cuts mean TTLT by", 3)
    _shows(cut, 1 - conversation["mean_ttlt_ratio_vs_global"], 100)
    _shows(recovered, (1 - conversation["mean_ttlt_ratio_vs_global"])
           / (1 - conversation["oracle_ttlt_ratio_vs_global"]), 100)
    _shows(oracle, conversation["oracle_ttlt_ratio_vs_global"] - 1, 100)
    cut, recovered = _after(text, "On the synthetic multi-turn trace the cut is", 2)
    _shows(cut, 1 - synthetic["mean_ttlt_ratio_vs_global"], 100)
    _shows(recovered, (1 - synthetic["mean_ttlt_ratio_vs_global"])
           / (1 - synthetic["oracle_ttlt_ratio_vs_global"]), 100)
    prior = "semantic (prior top-up)"
    for shown, row in zip(
        _after(text, "It orders best in both recurring regimes:", 4),
        (conversation, family("conversation", "recurring", prior),
         synthetic, family("synthetic", "recurring", prior)),
        strict=True,
    ):
        _shows(shown, row["mean_ttlt_ratio_vs_global"])
    mass, nearest = _after(text, "on the true bucket on the synthetic trace (", 2)
    _shows(mass, family("synthetic", "recurring", prior)["p_bucket"])
    _shows(nearest, synthetic["p_bucket"])
    alpaca = scores["per-model", "global", "-"]["p_bucket"]
    for shown, embedder in zip(_after(text, "AlpacaEval held-out:", 2), ("minilm", "hashing"),
                               strict=True):
        _shows(shown, scores["per-model", "semantic (nearest top-up)", embedder]["p_bucket"]
               / alpaca)
    for trace in ("conversation", "synthetic"):
        row = family(trace, "unique")
        shown_gain, shown_ttlt = _after(text, f"Mooncake {trace} unique:", 2)
        _shows(shown_gain, gain(row))
        _shows(shown_ttlt, row["mean_ttlt_ratio_vs_global"] - 1, 100)
    recurring, unique = _after(text, "Input length is a strong signal only on the synthetic", 2)
    _shows(recurring, gain(family("synthetic", "recurring", "input_length")))
    _shows(unique, gain(family("synthetic", "unique", "input_length")))
    real = family("conversation", "recurring", "input_length")
    _shows(_after(text, "On the real trace it is no better than global (")[0], gain(real))

    table = _table(text, "### Compact search against the full scan")
    assert len(table) == 4
    for r in table:
        scope, embedder = _plain(r["scope"]), _plain(r["embedder"]).lower()
        compact = scores[scope, "semantic (nearest top-up)", embedder]
        full = scores[scope, "semantic (nearest top-up, full scan)", embedder]
        _shows(r["P(true bucket), compact"], compact["p_bucket"])
        _shows(r["P(true bucket), full scan"], full["p_bucket"])
        _shows(r["median-bucket hit, compact"], compact["median_hit"])
        _shows(r["median-bucket hit, full scan"], full["median_hit"])

    def compact_vs_full(scope: str, embedder: str, key: str = "p_bucket") -> float:
        compact = scores[scope, "semantic (nearest top-up)", embedder][key]
        return float(compact / scores[scope, "semantic (nearest top-up, full scan)", embedder][key])

    within, hashing, minilm, within_hit = _after(text, "the compact search is within", 4)
    _shows(hashing, compact_vs_full("per-model", "hashing") - 1, 100)
    _shows(minilm, compact_vs_full("per-model", "minilm") - 1, 100)
    for bound, key in ((within, "p_bucket"), (within_hit, "median_hit")):
        worst = max(abs(compact_vs_full("per-model", e, key) - 1) for e in ("hashing", "minilm"))
        assert 100 * worst <= float(bound), f"per-model {key}: compact within {bound} %"
    _shows(_after(text, "In pooled scope with MiniLM it loses")[0],
           1 - compact_vs_full("pooled", "minilm"), 100)

    timings = {(t["what"], t["embedder"]): t for t in report["timings"]}
    for r in _table(text, "| what | embedder |"):
        t = timings[_LENGTH_TIMINGS[_plain(r["what"])], _plain(r["embedder"]).split()[0].lower()]
        _shows(r["median wall µs"], t["median_us"])
        _shows(r["mean CPU µs"], t["cpu_mean_us"])
    full_scan = [
        timings["predict (nearest top-up, full scan)", e]["median_us"]
        / timings["predict (nearest top-up)", e]["median_us"]
        for e in ("hashing", "minilm")
    ]
    low, high = _after(text, "On the threshold path the full scan costs", 2)
    _shows(low, min(full_scan))
    _shows(high, max(full_scan))
    embed = timings["embed (1 prompt)", "minilm"]
    cpu, wall = _after(text, "the real cost on CPU-only sidecars:", 2)
    _shows(cpu, embed["cpu_mean_us"], 1e-6)
    _shows(wall, embed["median_us"], 1e-6)
    _shows(_after(text, "The hashing embedder costs about")[0],
           timings["embed (1 prompt)", "hashing"]["median_us"], 1e-3)

    semantic = _ordering_summary("ordering-vllm.json")
    global_ = _ordering_summary("ordering-vllm-global.json")
    for r in _table(text, "### Inside vLLM, KV-bound"):
        load = float(_plain(r["load"]))
        for column, (ordering, cost) in _VLLM_ORDERINGS.items():
            key = (load, ordering, cost)
            _shows(r[column], semantic[key]["mean_ttlt_s"] / global_[key]["mean_ttlt_s"])
    memory, output = (
        [s["mean_ttlt_s"] / global_[k]["mean_ttlt_s"] - 1
         for k, s in semantic.items() if k in global_ and k[2] == cost]
        for cost in ("memory", "output")
    )
    low, high, most = _after(text, "summarisations: mean TTLT", 3)
    _shows(low, min(memory), 100)
    _shows(high, max(memory), 100)
    _shows(most, max(output), 100)
    oracle = _ordering_summary("ordering-vllm-oracle.json")

    def recovered(summary: dict[tuple[float, str, str], dict[str, Any]]) -> list[float]:
        out = []
        for load in {k[0] for k in global_}:
            fcfs = summary[load, "fcfs", "-"]["mean_ttlt_s"]
            best = oracle[load, "sjf", "memory"]["mean_ttlt_s"]
            for ordering in ("gittins-r200", "gittins-np"):
                out.append((fcfs - summary[load, ordering, "memory"]["mean_ttlt_s"])
                           / (fcfs - best))
        return out

    for phrase, summary in (
        ("the semantic predictor's Gittins (memory cost) recovers", semantic),
        ("and the global one", global_),
    ):
        low, high = _after(text, phrase, 2)
        _shows(low, min(recovered(summary)), 100)
        _shows(high, max(recovered(summary)), 100)


def test_ordering_ablations_predictor_figures() -> None:
    """ordering-ablations.md's global-predictor table and its semantic-against-global
    percentages, from ``ordering-vllm-global.json`` and ``ordering-vllm.json``."""
    text = (BENCH / "ordering-ablations.md").read_text()
    semantic = _ordering_summary("ordering-vllm.json")
    global_ = _ordering_summary("ordering-vllm-global.json")
    table = _table(text, "### What the predictor is worth here: the global distribution")
    assert len(table) == len(global_)
    for r in table:
        s = global_[float(_plain(r["load"])), _plain(r["ordering"]), _plain(r["cost"])]
        _shows(r["mean TTLT"], s["mean_ttlt_s"])
        _shows(r["p99 TTLT"], s["p99_ttlt_s"])
        _shows(r["p99 TTFT"], s["ttft_p99_s"])
    rows = _table(text, "Mean TTLT of the semantic predictor")
    assert len(rows) == len({k[0] for k in global_})
    for r in rows:
        load = float(_plain(r["load"]))
        for column, cell in r.items():
            if column == "load":
                continue
            found = re.fullmatch(r"(\S+) \((\w+)\)", column)
            assert found is not None, column
            key = (load, found.group(1), found.group(2))
            _shows(cell, semantic[key]["mean_ttlt_s"] / global_[key]["mean_ttlt_s"] - 1, 100)


def test_ordering_ablations_per_generator_figures() -> None:
    """ordering-ablations.md's one-model-stream table and prose, from the six
    ``ordering-vllm-gen-GENERATOR-PREDICTOR.json`` runs."""
    text = (BENCH / "ordering-ablations.md").read_text()
    table = _table(text, "### One model's stream: per generator")
    assert len(table) == 3
    ratios = {}
    for r in table:
        generator = _plain(r["generator"])
        semantic = _ordering_summary(f"ordering-vllm-gen-{generator}-semantic.json")
        global_ = _ordering_summary(f"ordering-vllm-gen-{generator}-global.json")
        for predictor, run in (("semantic", semantic), ("global", global_)):
            doc = _load(f"ordering-vllm-gen-{generator}-{predictor}.json")
            assert doc["generator"] == generator and doc["engine"] == "vllm"
            assert (doc["predictor"] == "global distribution") == (predictor == "global")
            assert set(run) == {(0.9, "fcfs", "-"), (0.9, "gittins-r200", "memory")}
        fcfs, gittins = (0.9, "fcfs", "-"), (0.9, "gittins-r200", "memory")
        assert semantic[fcfs]["mean_ttlt_s"] == global_[fcfs]["mean_ttlt_s"]
        _shows(r["FCFS mean TTLT"], semantic[fcfs]["mean_ttlt_s"])
        _shows(r["Gittins mean TTLT, semantic"], semantic[gittins]["mean_ttlt_s"])
        _shows(r["Gittins mean TTLT, global"], global_[gittins]["mean_ttlt_s"])
        ratios[generator] = semantic[gittins]["mean_ttlt_s"] / global_[gittins]["mean_ttlt_s"]
        _shows(r["semantic / global"], ratios[generator])
        _shows(r["Gittins p99 TTFT, semantic"], semantic[gittins]["ttft_p99_s"])
        _shows(r["Gittins p99 TTFT, global"], global_[gittins]["ttft_p99_s"])
    lower, higher, highest = _after(text, "Gittins's mean TTLT is", 3)
    _shows(lower, 1 - ratios["text_davinci_003"], 100)
    _shows(higher, ratios["Mistral-7B-Instruct-v0.2"] - 1, 100)
    _shows(highest, ratios["gpt4_1106_preview"] - 1, 100)


def test_length_predictor_per_generator_figures() -> None:
    """length-predictor.md's per-generator table, from
    ``length-predictor-per-generator.json``."""
    text = (BENCH / "length-predictor.md").read_text()
    report = _load("length-predictor-per-generator.json")
    scores = {s["predictor"]: s["p_bucket_by_generator"] for s in report["scores"]
              if s["scope"] == "per-model"}
    table = _table(text, "### One model's stream: per generator")
    assert {_plain(r["generator"]) for r in table} == set(scores["global"])
    for r in table:
        g = _plain(r["generator"])
        _shows(r["global"], scores["global"][g])
        _shows(r["input length"], scores["input_length"][g])
        semantic = scores["semantic (nearest top-up)"][g]
        _shows(r["semantic (hashing, nearest top-up)"], semantic)
        _shows(r["semantic vs global"], semantic / scores["global"][g])
    gains = [scores["semantic (nearest top-up)"][g] / scores["global"][g] for g in scores["global"]]
    assert max(gains) < 1.5  # "No generator reaches 1.5×"


_SOAK_KINDS = {"vLLM": "kill-engine", "sidecar": "kill-sidecar", "operator": "kill-operator"}


def test_reliability_soak_figures() -> None:
    """docs/reliability.md's soak table is the soak reports its `report` row names, column by
    column (the engine and sidecar mode reports at least)."""
    table = _table((DOCS / "reliability.md").read_text(), "| soak |")
    rows = {_plain(r["soak"]): r for r in table}
    columns = [c for c in table[0] if c != "soak"]
    reports = {column: _plain(rows["report"][column]) for column in columns}
    assert {"soak-engine.json", "soak-sidecar.json"} <= set(reports.values()), reports
    for column, name in reports.items():
        doc = _load(name)
        verdict, config = doc["verdict"], doc["config"]
        assert config["mode"] == column.split()[0] and config["duration_s"] == 1800
        cell = {label: row[column] for label, row in rows.items()}
        _shows(cell["seed"], config["seed"])
        _shows(cell["share of the trace sent"], config["keep"])
        strikes = verdict["strikes"]
        counts = [sum(s["kind"] == kind for s in strikes) for kind in _SOAK_KINDS.values()]
        faults = cell["faults: vLLM / sidecar / operator"]
        assert [int(n) for n in _NUMBER.findall(faults)] == counts
        for who, kind in _SOAK_KINDS.items():
            downs = [s["down_s"] for s in strikes if s["kind"] == kind]
            low, high = _NUMBER.findall(cell[f"{who} served again after"])[:2]
            _shows(low, min(downs))
            _shows(high, max(downs))
        online = verdict["online"]
        _shows(cell["online requests"], online["sent"])
        for outcome in ("ok", "refused", "cut", "timeout"):
            _shows(cell[outcome], online["outcomes"].get(outcome, 0))
        clean = sum(n for k, n in online["outcomes"].items()
                    if k.startswith("http_") or k == "stream_error")
        _shows(cell["HTTP error or error event"], clean)
        _shows(cell["failures a fault explains"], sum(online["failures_explained_by"].values()))
        _shows(cell["failures no fault explains"], len(online["unexplained"]))
        offline = verdict["offline"]
        _shows(cell["OfflineJobs finished"], offline["jobs_finished"])
        assert offline["jobs_unfinished"] == 0
        _shows(cell["offline requests checked"], offline["requests"])
        lost, duplicated = _NUMBER.findall(cell["custom_ids lost / duplicated"])[:2]
        _shows(lost, offline["lost"])
        _shows(duplicated, offline["duplicated"])
        assert _plain(cell["held"]).startswith("yes" if verdict["held"] else "no")
