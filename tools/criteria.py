"""The open issues' performance criteria, judged from a figures run's JSON.

Run: ``python tools/criteria.py FOLDER [FOLDER ...] [--json OUT]``, each FOLDER the
output of ``bash tools/gpu_run.sh figures-a|figures-b|figures-c`` (or any folder below
which the benchmarks wrote ``bench.json``, ``overlap.json``, ``tp.json`` or
``train.json``).  Prints one row per criterion: what was measured, beside what, and
whether it is met; a criterion with no data says so instead of passing.

Every comparison is within one benchmark run (one JSON), as the issues ask.  Issue 29's
rows (``hoccl-auto`` within 5 % of the fastest hand-set hoccl variant) come from any
``python -m hoccl.bench --libraries hoccl-auto,...`` run (``bash tools/gpu_checks.sh
tune2``): ``python tools/criteria.py FOLDER`` (its rows of issue 29).  Where a
criterion names "hoccl", the row reports hoccl's defaults and the best hoccl variant
the run measured, each with its name, so a pass through a non-default setting is seen
as one.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from hoccl.bench._harness import human, parse_size

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
NCCL = ("nccl", "nccl4py", "nccl-zero")
SMALL = (64 * KiB, 256 * KiB, MiB)

Row = Dict[str, Any]


_LINE = re.compile(r"^\s+(\w+)\s+(in|out)\s+(\d+[KMG]?)\s+(\S+)\s+([\d.]+) us\s+([\d.]+) GB/s"
                   r"\s+wrong (\d+)(?:\s+rounds ([\d.,]+) us)?\s*$")


def bench_log_records(path: str) -> List[Dict[str, Any]]:
    """The records a ``hoccl.bench`` run printed, one line each, for a run stopped before
    it wrote its JSON (a time limit): the same numbers, from the same run."""
    records = []
    with open(path) as handle:
        for line in handle:
            found = _LINE.match(line)
            if found is None:
                continue
            collective, form, size, library, micros, busbw, wrong, rounds = found.groups()
            record = dict(collective=collective, form=form, bytes=parse_size(size),
                          library=library, time_us=float(micros), busbw=float(busbw),
                          wrong=int(wrong))
            if rounds:
                record["rounds_us"] = [float(value) for value in rounds.split(",")]
            records.append(record)
    return records


def load(folders: Sequence[str]) -> Dict[str, List[Tuple[str, Dict[str, Any]]]]:
    """Every benchmark JSON below ``folders``, by kind: (path, content); and the printed
    records of a ``hoccl.bench`` log (``NAME.log`` beside no ``NAME/bench.json``)."""
    found: Dict[str, List[Tuple[str, Dict[str, Any]]]] = {
        "bench": [], "overlap": [], "tp": [], "train": []}
    for folder in folders:
        for kind in found:
            for path in sorted(glob.glob(os.path.join(folder, "**", f"{kind}.json"),
                                         recursive=True)):
                with open(path) as handle:
                    found[kind].append((path, json.load(handle)))
        for path in sorted(glob.glob(os.path.join(folder, "**", "*.log"), recursive=True)):
            if os.path.exists(os.path.join(path[:-len(".log")], "bench.json")):
                continue
            records = bench_log_records(path)
            if records:
                found["bench"].append((path, {"records": records}))
    return found


def _row(issue: int, criterion: str, met: Optional[bool], measured: str, source: str = "") -> Row:
    return {"issue": issue, "criterion": criterion,
            "verdict": "no data" if met is None else ("met" if met else "NOT met"),
            "measured": measured, "source": source}


def _records(runs: Iterable[Tuple[str, Dict[str, Any]]]) -> Iterable[Tuple[str, Dict[str, Any]]]:
    for path, result in runs:
        for record in result.get("records", []):
            if "error" not in record and not record.get("wrong"):
                yield path, record


# -- issue 14 --------------------------------------------------------------------------------
def small_messages(runs: List[Tuple[str, Dict[str, Any]]]) -> List[Row]:
    rows: List[Row] = []
    by_run: Dict[str, Dict[Tuple[str, str, int, str], float]] = {}
    for path, record in _records(runs):
        key = (record["collective"], record["form"], record["bytes"], record["library"])
        by_run.setdefault(path, {})[key] = record["time_us"]

    def compare(collective: str, form: str, nbytes: int, graph: bool,
                prefix: str) -> Optional[Tuple[str, float, str, float, str]]:
        """(fastest hoccl library named ``prefix...``, its µs, fastest NCCL mode, its µs,
        source), eager or in a graph, within one run."""
        for path, times in by_run.items():
            names = [key[3] for key in times if key[:3] == (collective, form, nbytes)
                     and key[3].endswith("+graph") == graph]
            base = {name: name[:-len("+graph")] if graph else name for name in names}
            mine = [(name, times[(collective, form, nbytes, name)]) for name in names
                    if base[name].startswith(prefix)]
            theirs = [(name, times[(collective, form, nbytes, name)]) for name in names
                      if base[name] in NCCL]
            if mine and theirs:
                return (*min(mine, key=lambda x: x[1]), *min(theirs, key=lambda x: x[1]), path)
        return None

    for collective, form in (("all_gather", "in"), ("all_to_all", "out"), ("broadcast", "in")):
        for nbytes in SMALL:
            found = compare(collective, form, nbytes, True, "hoccl-reg")
            rows.append(_ratio_row(14, f"{collective} {human(nbytes)} registered, in a graph "
                                   f"≤ NCCL's fastest mode in a graph", found, 1.0))
    for collective in ("all_reduce", "reduce_scatter"):
        for nbytes in SMALL:
            found = compare(collective, "in", nbytes, True, "hoccl-reg")
            rows.append(_ratio_row(14, f"{collective} {human(nbytes)} registered, in a graph "
                                   f"≤ 1.2 × NCCL's fastest mode in a graph", found, 1.2))
    found = compare("all_gather", "in", MiB, False, "hoccl-reg")
    rows.append(_ratio_row(14, "all_gather 1M registered, eager ≤ 1.5 × NCCL's fastest eager "
                           "mode", found, 1.5))
    # 1 GiB in place: bandwidth, higher is better; a row per run that has both
    criterion = "all_gather 1G in place ≥ NCCL zero-SM's busbw"
    before = len(rows)
    for path, result in runs:
        records = {r["library"]: r["busbw"] for r in result.get("records", [])
                   if r.get("collective") == "all_gather" and r.get("form") == "in"
                   and r.get("bytes") == GiB and "error" not in r and not r.get("wrong")}
        zero = records.get("nccl-zero")
        mine = [(name, value) for name, value in records.items() if name.startswith("hoccl")
                and not name.endswith("+graph")]
        if zero and mine:
            name, value = max(mine, key=lambda x: x[1])
            rows.append(_row(14, criterion, value >= zero, f"{name} {value:.1f} GB/s vs "
                             f"nccl-zero {zero:.1f} ({value / zero:.3f}×)", path))
    if len(rows) == before:
        rows.append(_row(14, criterion, None, ""))
    return rows


def _ratio_row(issue: int, criterion: str,
               found: Optional[Tuple[str, float, str, float, str]], limit: float) -> Row:
    if found is None:
        return _row(issue, criterion, None, "")
    mine, mine_us, theirs, theirs_us, path = found
    ratio = mine_us / theirs_us
    return _row(issue, criterion, ratio <= limit,
                f"{mine} {mine_us:.1f} µs vs {theirs} {theirs_us:.1f} µs ({ratio:.2f}×)", path)


# -- issue 13 --------------------------------------------------------------------------------
def _sum_sms(text: str) -> Optional[int]:
    """The summing SMs of an overlap record's ``sms`` text (``... sums: ≤ 8``)."""
    marker = text.rfind("≤ ")
    if "sums" not in text or marker < 0:
        return None
    digits = "".join(ch for ch in text[marker + 2:] if ch.isdigit())
    return int(digits) if digits else None


def beside_compute(runs: List[Tuple[str, Dict[str, Any]]]) -> List[Row]:
    rows: List[Row] = []
    for collective in ("reduce_scatter", "all_reduce"):
        criterion = f"{collective} beside the GEMM: slowdown ≤ NCCL's and busbw ≥ 1.3 × NCCL's"
        before = len(rows)
        for path, result in runs:
            records = [r for r in result.get("records", []) if r.get("collective") == collective]
            nccl = next((r for r in records if r["library"] == "nccl"), None)
            candidates = []
            for record in records:
                if nccl is None or not record["library"].startswith("hoccl"):
                    continue
                met = (record["slowdown_pct"] <= nccl["slowdown_pct"]
                       and record["busbw_during"] >= 1.3 * nccl["busbw_during"])
                candidates.append((met, record["busbw_during"] / nccl["busbw_during"], record))
            if not candidates:
                continue
            # the variant that meets it with the most bandwidth, else the fastest beside
            met, ratio, record = max(candidates, key=lambda c: (c[0], c[1]))
            rows.append(_row(13, criterion, met,
                             f"{record['library']}: {record['slowdown_pct']:.1f} % at "
                             f"{record['busbw_during']:.1f} GB/s vs nccl "
                             f"{nccl['slowdown_pct']:.1f} % at {nccl['busbw_during']:.1f} "
                             f"({ratio:.2f}×)", path))
        if len(rows) == before:
            rows.append(_row(13, criterion, None, ""))
    return rows


def reduce_scatter_alone(overlap: List[Tuple[str, Dict[str, Any]]],
                         bench: List[Tuple[str, Dict[str, Any]]]) -> List[Row]:
    """A row per run that has NCCL (torch.distributed) and a hoccl variant summing on at
    most 16 SMs: the overlap benchmark's collectives alone (1 GiB), and the sweep's
    reduce_scatter at 256 MiB or more (results checked, in place or out of place alike)."""
    criterion = "reduce_scatter alone ≥ 1.0 × NCCL's busbw (torch.distributed) with ≤ 16 SMs"
    rows: List[Row] = []
    sources = [(path, result, "busbw_alone") for path, result in overlap]
    sources += [(path, result, "busbw") for path, result in bench]
    for path, result, key in sources:
        records = [r for r in result.get("records", []) if r.get("collective") == "reduce_scatter"
                   and "error" not in r and not r.get("wrong") and key in r
                   and not r["library"].endswith("+graph")
                   and (key == "busbw_alone" or r.get("bytes", 0) >= 256 * MiB)]
        for size, form in sorted({(r.get("bytes", 0), r.get("form", "")) for r in records}):
            same = [r for r in records if (r.get("bytes", 0), r.get("form", "")) == (size, form)]
            nccl = next((r for r in same if r["library"] == "nccl"), None)
            mine = [(r, _sum_sms(r.get("sms", ""))) for r in same
                    if r["library"].startswith("hoccl")]
            mine = [(r, sms) for r, sms in mine if sms is not None and sms <= 16]
            if nccl and mine:
                record, sms = max(mine, key=lambda pair: pair[0][key])
                ratio = record[key] / nccl[key]
                rows.append(_row(13, criterion, ratio >= 1.0,
                                 f"{human(size)} {form}: {record['library']} "
                                 f"({sms} SMs) {record[key]:.1f} GB/s vs nccl {nccl[key]:.1f} "
                                 f"({ratio:.2f}×)", path))
    return rows or [_row(13, criterion, None, "")]


def tensor_parallel(runs: List[Tuple[str, Dict[str, Any]]]) -> List[Row]:
    criterion = "TP layer: hoccl overlapped ≤ 0.9 × NCCL overlapped and ≤ async-TP"
    for path, result in runs:
        timed = [r for r in result.get("records", []) if r.get("ms_per_layer") is not None
                 and not r.get("wrong")]
        mine = [r for r in timed if r["library"].startswith("hoccl") and r["overlapped"]]
        nccl = [r for r in timed if r["library"] == "nccl" and r["overlapped"]]
        fused = [r for r in timed if r["library"] == "async-tp"]
        if mine and nccl:
            best = min(mine, key=lambda r: r["ms_per_layer"])
            theirs = min(nccl, key=lambda r: r["ms_per_layer"])
            ratio = best["ms_per_layer"] / theirs["ms_per_layer"]
            met = ratio <= 0.9
            text = (f"{best['library']} {best['label']} {best['ms_per_layer']:.2f} ms vs nccl "
                    f"{theirs['label']} {theirs['ms_per_layer']:.2f} ms ({ratio:.2f}×)")
            if fused:
                other = min(fused, key=lambda r: r["ms_per_layer"])
                met = met and best["ms_per_layer"] <= other["ms_per_layer"]
                text += f"; async-TP {other['ms_per_layer']:.2f} ms"
            else:
                met = False
                text += "; async-TP did not run"
            return [_row(13, criterion, met, text, path)]
    return [_row(13, criterion, None, "")]


# -- issue 12 --------------------------------------------------------------------------------
def training(runs: List[Tuple[str, Dict[str, Any]]]) -> List[Row]:
    rows: List[Row] = []
    exposed: List[Tuple[float, str, Row]] = []
    for path, result in runs:
        baseline = result.get("baseline", "nccl")
        by_shape: Dict[str, List[Dict[str, Any]]] = {}
        for record in result.get("records", []):
            by_shape.setdefault(record["shape"], []).append(record)
        for shape, records in by_shape.items():
            base = next((r for r in records if r["library"] == baseline), None)
            mine = [r for r in records if r["library"].startswith("hoccl")]
            if base is None or not mine:
                continue
            best = max(mine, key=lambda r: r["tokens_per_s"])
            ratio = best["tokens_per_s"] / base["tokens_per_s"]
            row = _row(12, f"training tokens/s ≥ 1.00 × {baseline}, shape {shape}", ratio >= 1.0,
                       f"{best['library']} {best['tokens_per_s']:,.0f} vs {baseline} "
                       f"{base['tokens_per_s']:,.0f} ({ratio:.3f}×)"
                       + _default_note(mine, base), path)
            rows.append(row)
            profile = base.get("profile_ms_per_step") or {}
            exposed.append((profile.get("exposed", 0.0), shape,
                            dict(row, criterion=f"training tokens/s ≥ 1.05 × {baseline} where "
                                 f"communication is most exposed (shape {shape})",
                                 verdict="met" if ratio >= 1.05 else "NOT met")))
    if exposed:
        rows.append(max(exposed, key=lambda item: item[0])[2])
    else:
        rows.append(_row(12, "training tokens/s ≥ 1.00 × NCCL at every shape", None, ""))
    return rows


# -- issue 29 --------------------------------------------------------------------------------
AUTO = "hoccl-auto"


def auto_within(runs: List[Tuple[str, Dict[str, Any]]], limit: float = 1.05) -> List[Row]:
    """``hoccl-auto`` (each call from the machine's table) against the fastest hand-set
    hoccl variant of the same collective, form and size, eager or in a graph, within one
    run: a row per point where both ran.  Times are the records' (the median round of a
    ``--rounds`` run); a row of such a run also gives both libraries' range of rounds."""
    criterion = f"{AUTO} ≤ {limit} × the fastest hand-set hoccl variant"
    rows: List[Row] = []
    for path, result in runs:
        points: Dict[Tuple[str, str, int, bool], Dict[str, Dict[str, Any]]] = {}
        for _, record in _records([(path, result)]):
            graph = record["library"].endswith("+graph")
            points.setdefault((record["collective"], record["form"], record["bytes"], graph),
                              {})[record["library"]] = record
        for (collective, form, nbytes, graph), found in sorted(points.items()):
            auto = AUTO + ("+graph" if graph else "")
            hand = [(name, record["time_us"]) for name, record in found.items()
                    if name.startswith("hoccl") and not name.startswith(AUTO)]
            if auto in found and hand:
                best, best_us = min(hand, key=lambda x: x[1])
                row = _ratio_row(29, f"{collective} {form} {human(nbytes)}"
                                 f"{' in a graph' if graph else ''}: {criterion}",
                                 (auto, found[auto]["time_us"], best, best_us, path), limit)
                spreads = [_spread(name, found[name]) for name in (auto, best)]
                if all(spreads):
                    row["measured"] += f"; rounds {', '.join(spreads)} µs"
                rows.append(row)
    return rows or [_row(29, criterion, None, "")]


def _spread(name: str, record: Dict[str, Any]) -> str:
    """``NAME low–high`` of a record's rounds, or "" for a record of one round."""
    rounds = record.get("rounds_us") or []
    return f"{name} {min(rounds):.1f}–{max(rounds):.1f}" if len(rounds) > 1 else ""


def _default_note(mine: List[Dict[str, Any]], base: Dict[str, Any]) -> str:
    plain = next((r for r in mine if r["library"] == "hoccl"), None)
    if plain is None:
        return ""
    return f"; hoccl group {plain['tokens_per_s'] / base['tokens_per_s']:.3f}×"


def judge(folders: Sequence[str]) -> List[Row]:
    found = load(folders)
    return (small_messages(found["bench"]) + beside_compute(found["overlap"])
            + reduce_scatter_alone(found["overlap"], found["bench"])
            + tensor_parallel(found["tp"]) + training(found["train"])
            + auto_within(found["bench"]))


def markdown(rows: Sequence[Row]) -> str:
    lines = ["| issue | criterion | verdict | measured | source |", "|---|---|---|---|---|"]
    lines += [f"| {r['issue']} | {r['criterion']} | {r['verdict']} | {r['measured']} | "
              f"{r['source']} |" for r in rows]
    lines.append("")
    for issue in sorted({r["issue"] for r in rows}):
        mine = [r for r in rows if r["issue"] == issue]
        counts = {verdict: sum(r["verdict"] == verdict for r in mine)
                  for verdict in ("met", "NOT met", "no data")}
        lines.append(f"issue {issue}: {counts['met']} met, {counts['NOT met']} not met, "
                     f"{counts['no data']} without data (rows of every run found)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    rows = judge(args.folders)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
