"""`megatron-ppo plan`'s output can be read and checked: full, unique column names with the unit, every row's parts
adding up to its total (the text table, parsed, and --json), the alternatives a layout does not use kept out of
the columns (--breakdown and --json carry them), and the colocated summary adding up too."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest

from megatron_ppo.plan import Memory
from megatron_ppo.plan.cli import ALTERNATIVES, NOT_COUNTED, PARTS, PHASES, RESIDENT, main, split

CONFIGS = [("ppo_70b",), ("ppo_70b", "--all"), ("gsm8k_7b",), ("tiny_cpu",)]
FULL_NAMES = {f.name for f in dataclasses.fields(Memory)} | {"layout", "total", "note"}
LABEL = re.compile(r"[* ] (TP\d+ PP\d+ DP\d+(?: SP)? rc=\w+(?: off=opt)?)")
HALF = 0.005  # half the last printed digit (2 decimals)


def _run(capsys, *args):
    rc = main(list(args))
    return rc, capsys.readouterr().out


def parse_tables(text: str) -> dict:
    """{role: {"unit", "names", "rows": [{"layout", "cells": {name: float | None ('-')}, "note", "more"}]}} from
    the printed per-role tables. A numeric cell must end exactly under the end of its header name."""
    lines = text.splitlines()
    tables = {}
    for i, line in enumerate(lines):
        m = re.match(r"(\w+): [\d,]+ parameters", line)
        if not m:
            continue
        unit = re.match(r"\s*(GiB|MiB) per GPU\b", lines[i + 1])
        assert unit, f"no unit on the line above {m.group(1)}'s header: {lines[i + 1]!r}"
        head = lines[i + 2]
        spans = [(w.group(), w.start(), w.end()) for w in re.finditer(r"\S+", head)]
        names = [n for n, _, _ in spans]
        rows = []
        for row in lines[i + 3:]:
            if not row.strip() or row.lstrip().startswith("("):
                break
            if row.startswith("      "):  # --breakdown: the line under a layout
                rows[-1]["more"] = row.strip()
                continue
            label = LABEL.match(row)
            assert label, row
            cells = {}
            for name, start, end in spans[1:-1]:  # numbers right-aligned to their header's end
                assert row[end:end + 1] in ("", " ") and row[end - 1] != " ", (name, head, row)
                token = row[:end].split()[-1]
                cells[name] = None if token == NOT_COUNTED else float(token)
            note_start = spans[-1][1]
            assert row[note_start - 1] == " ", (head, row)
            rows.append({"layout": label.group(1), "cells": cells, "note": row[note_start:], "more": None})
        tables[m.group(1)] = {"unit": unit.group(1), "names": names, "rows": rows}
    return tables


@pytest.mark.parametrize("args", CONFIGS)
def test_header_names_are_full_unique_and_carry_the_unit(capsys, args):
    _, out = _run(capsys, "--config", *args)
    tables = parse_tables(out)
    assert set(tables) >= {"actor", "critic"}
    for role, t in tables.items():
        names = t["names"]
        assert len(names) == len(set(names)), (role, names)  # no two columns with one name
        assert set(names) <= FULL_NAMES, (role, set(names) - FULL_NAMES)  # no name cut short
        assert names[0] == "layout" and names[-2:] == ["total", "note"], names
        assert not set(names) & set(ALTERNATIVES), names  # alternatives are not columns
        assert t["rows"], role
    assert {t["unit"] for t in tables.values()} == ({"MiB"} if args == ("tiny_cpu",) else {"GiB"})


@pytest.mark.parametrize("args", CONFIGS)
def test_text_rows_add_up_to_their_total(capsys, args):
    """Parse the table: the columns between layout and total (the '-' phase excluded) sum to total, up to the
    printed rounding."""
    _, out = _run(capsys, "--config", *args)
    checked = 0
    for role, t in parse_tables(out).items():
        for row in t["rows"]:
            cells = dict(row["cells"])
            total = cells.pop("total")
            parts = [v for v in cells.values() if v is not None]
            assert abs(sum(parts) - total) <= HALF * (len(parts) + 1) + 1e-9, (role, row)
            # exactly one transient phase is counted; the other shows '-'
            left_out = {k for k, v in cells.items() if v is None}
            assert left_out in ({*PHASES["training"]}, {*PHASES["generation"]}), (role, row)
            checked += 1
    assert checked > 10


def test_text_agrees_with_json_and_the_model(capsys):
    """The printed numbers are the memory model's, not a sum made up to match: text cells = --json parts (and the
    '-' cells = its not_counted phase), --json total = memory(...).total of the configured layout."""
    from megatron_ppo.config import load_config
    from megatron_ppo.plan import memory
    from megatron_ppo.plan.layouts import role_specs, with_world

    _, out = _run(capsys, "--config", "ppo_70b", "--all")
    _, js = _run(capsys, "--config", "ppo_70b", "--json")
    d = json.loads(js)
    for role, t in parse_tables(out).items():
        by_label = {r["layout"]: r["memory_gib"] for r in d["layouts"][role]}
        assert len(by_label) == len(t["rows"])
        for row in t["rows"]:
            m = by_label[row["layout"]]
            assert abs(row["cells"]["total"] - m["total"]) <= HALF + 1e-9
            for k in PARTS:
                if k in m["parts"]:
                    assert abs(row["cells"][k] - m["parts"][k]) <= HALF + 1e-9, (role, row, k)
                else:
                    assert row["cells"][k] is None and k in m["not_counted"], (role, row, k)
    cfg = load_config("ppo_70b", [])
    for role, spec in with_world(role_specs(cfg, d["gpus"]), d["gpus"]).items():
        mem = memory(spec.arch, role, spec.layout, spec.work)
        assert d["configured"][role]["memory_gib"]["total"] == pytest.approx(mem.total / 2 ** 30, rel=1e-12)
        assert d["configured"][role]["memory_gib"]["alternatives"] == pytest.approx(
            {k: getattr(mem, k) / 2 ** 30 for k in ALTERNATIVES}, rel=1e-12)


@pytest.mark.parametrize("config", ["ppo_70b", "gsm8k_7b", "tiny_cpu"])
def test_json_rows_carry_parts_that_sum_to_the_total(capsys, config):
    rc, js = _run(capsys, "--config", config, "--json")
    d = json.loads(js)
    rows = [r["memory_gib"] for rs in d["layouts"].values() for r in rs]
    rows += [c["memory_gib"] for c in d["configured"].values()]
    assert len(rows) > 10
    for m in rows:
        assert sum(m["parts"].values()) == pytest.approx(m["total"], rel=1e-12, abs=1e-12), m
        assert set(m["parts"]) == set(RESIDENT) | set(PHASES[m["peak_phase"]]), m
        assert set(m["parts"]) | set(m["not_counted"]) == set(PARTS) and not set(m["parts"]) & set(m["not_counted"])
        assert sum(m["not_counted"].values()) <= sum(m["parts"][k] for k in PHASES[m["peak_phase"]]) + 1e-12
        assert set(m["alternatives"]) == set(ALTERNATIVES), m
    c = d["colocated"]  # one process per role: its resident memory + its own transient peak + a CUDA context
    for role, held in c["process_gib"].items():
        assert c["resident_gib"][role] + c["transient_gib"][role] + c["context_gib"] == pytest.approx(held, rel=1e-12)
    assert sum(c["process_gib"].values()) == pytest.approx(c["total_gib"], rel=1e-12)
    assert c["total_gib"] == d["colocated_gib"]
    assert c["context_gib"] == (0.0 if config == "tiny_cpu" else 1.0)  # no CUDA context on a CPU config
    released = sum(c["resident_gib"].values()) + len(c["process_gib"]) * c["context_gib"] + max(
        c["transient_gib"].values())
    assert c["released_peak_gib"] == pytest.approx(released, rel=1e-12)


def test_split_is_exactly_memory_total_in_bytes(capsys):
    """If memory.py's total gains a term the table does not show, this fails (bytes, no rounding)."""
    from megatron_ppo.config import load_config
    from megatron_ppo.plan import Hardware
    from megatron_ppo.plan.layouts import enumerate_layouts, role_specs, with_world

    n = 0
    for config in ("ppo_70b", "tiny_cpu"):
        cfg = load_config(config, [])
        gpus = cfg.cluster.world_size
        for spec in with_world(role_specs(cfg, gpus), gpus).values():
            for row in enumerate_layouts(spec, gpus, min(cfg.cluster.n_gpus_per_node, gpus), Hardware()):
                s = split(row.mem)
                assert sum(s["parts"].values()) == row.mem.total == s["total"], (config, row.layout)
                n += 1
    assert n > 100


def test_breakdown_keeps_the_alternatives(capsys):
    """--breakdown: one more line per layout with the phase left out and the alternatives; the table is unchanged."""
    _, plain = _run(capsys, "--config", "ppo_70b")
    _, more = _run(capsys, "--config", "ppo_70b", "--breakdown")
    _, js = _run(capsys, "--config", "ppo_70b", "--json")
    t0, t1 = parse_tables(plain), parse_tables(more)
    assert [[(r["layout"], r["cells"]) for r in t["rows"]] for t in t0.values()] == \
        [[(r["layout"], r["cells"]) for r in t["rows"]] for t in t1.values()]
    assert all(r["more"] is None for t in t0.values() for r in t["rows"])
    assert all(r["more"] for t in t1.values() for r in t["rows"])
    actor = next(r for r in t1["actor"]["rows"] if r["layout"] == "TP8 PP4 DP4 SP rc=full")
    m = json.loads(js)["configured"]["actor"]["memory_gib"]
    assert m["peak_phase"] == "training"
    for text in (f"generation kv_cache {m['not_counted']['kv_cache']:.2f}",
                 f"optimizer replicated {m['alternatives']['optimizer_replicated']:.2f}",
                 f"distributed (/DP4) {m['alternatives']['optimizer_distributed']:.2f}",
                 f"activations without recompute {m['alternatives']['activations_no_recompute']:.2f}"):
        assert text in actor["more"], (text, actor["more"])
    ref = next(r for r in t1["ref"]["rows"] if r["layout"] == "TP8 PP4 DP4 SP rc=none")
    assert "no generation phase" in ref["more"] and "no optimizer" in ref["more"]


@pytest.mark.parametrize("config", ["ppo_70b", "tiny_cpu"])
def test_colocated_summary_adds_up(capsys, config):
    _, out = _run(capsys, "--config", config)
    lines = out.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith("configured layouts, colocated"))
    head = lines[i + 1].split()
    assert head == ["role", "layout", *RESIDENT, "resident", "transient", "context", "process", "phase"]
    sums = [0.0, 0.0, 0.0, 0.0]  # resident, transient, context, process over the roles
    n = 0
    for line in lines[i + 2:]:
        if line.strip().startswith("total ="):
            break
        nums = [float(x) for x in re.findall(r"\s(\d+\.\d\d)(?=\s)", line + " ")]
        w, g, o, res, tr, ctx, held = nums[-7:]
        assert abs(w + g + o - res) <= 4 * HALF + 1e-9, line
        assert abs(res + tr + ctx - held) <= 4 * HALF + 1e-9, line  # each process: resident + transient + context
        sums = [a + b for a, b in zip(sums, (res, tr, ctx, held))]
        n += 1
    m = re.search(r"total = (\d+) processes: resident (\d+\.\d+) \+ transient (\d+\.\d+) \+ context "
                  r"(\d+\.\d+) = (\d+\.\d+) (GiB|MiB) per GPU", line)
    assert m, line
    assert int(m.group(1)) == n
    r, t, c, total = (float(x) for x in m.groups()[1:5])
    assert abs(r + t + c - total) <= 4 * HALF + 1e-9, line
    for printed, summed in zip((r, t, c, total), sums):
        assert abs(printed - summed) <= 2 * n * HALF + 1e-9, (line, sums)
