"""Write the measured tables of RESULTS.md (and README.md's glance table) from the JSON beside this file.

    python results/render.py           # rewrite every generated block in place
    python results/render.py --check   # exit 1 when a block differs from its data (tests/test_results.py)

A generated block is the text between `<!-- generated: NAME -->` and `<!-- end -->`; NAME is its data:
`quality-SET-GRID`, a grid of the sweep SET in quality-provenance.json (tools/sweep.py prints the same
tables); `glance` / `line-KEY`, README's glance table / one of its sentences (glance.json), each number a
cell of another block; else the table NAME.json with its provenance. Every block says where its numbers come
from and which commits trained its rows. The data is read as data: nothing non-finite, every row as long as
its columns, a format of one field; every document renders before any is written. Standard library only.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import math
import os
import re
import string
import sys
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DOCUMENTS = ("RESULTS.md", "README.md")
BLOCK = re.compile(r"(<!-- generated: ([\w.-]+) -->\n)(.*?)(<!-- end -->)", re.S)

sys.path.insert(0, ROOT)  # the project's lib/ (run as python results/render.py, its folder is on the path)
from lib.tables import GRIDS, markdown_table  # noqa: E402  (the sweep's tables, stdlib only)

# A rendered block: its markdown, its table's cells (for references), the commit each row was trained at.
Block = collections.namedtuple("Block", "text cells row_commits", defaults=[None])


def refuse(what: str):
    raise SystemExit(f"results/render.py: {what}")


def finite(text: str) -> float:
    """A JSON number as render takes it: NaN, Infinity and 1e400 are refused where they are read ("nan%")."""
    if not math.isfinite(float(text)):
        raise ValueError(f"{text} is not a finite number")
    return float(text)


def load(name: str):
    try:
        with open(os.path.join(HERE, name), encoding="utf-8") as f:
            return json.load(f, parse_constant=finite, parse_float=finite)
    except FileNotFoundError:
        refuse(f"a generated block names {name!r}, but results/{name} does not exist")
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # torn, edited, not JSON
        refuse(f"results/{name} is not readable JSON ({type(e).__name__}: {' '.join(str(e).split())[:160]}); "
               f"restore it from git or rerun its command")


def provenance_lines(p: dict) -> list[str]:
    """'Measured DATE at commit C on HARDWARE, torch T:' and the command(s) that measured the table."""
    commits = p["commit"].split(", ")
    named = ", ".join(f"`{c}`" for c in commits)
    lines = [f"Measured {p['date']} at commit{'s' * (len(commits) > 1)} {named} on {p['hardware']}, "
             f"torch {p['torch']}" + (f"; {p['note']}" if p.get("note") else "") + ":"]
    commands = p["command"] if isinstance(p["command"], list) else [p["command"]]
    return lines + ["", "```bash", *commands, "```"]


# --- a table written as measured: results/NAME.json ---

ONE_FIELD = re.compile(r"[^{}]*\{(:[^{}]*)?\}[^{}]*")  # '{}' or '{:SPEC}': no names, attributes or indexes


def cell_text(value, fmt: str | None) -> str:
    """Numbers through the column's format ('{:.2f}%'); strings ('–', '1.000 (0.98–1.02)') as they are."""
    if not (fmt and isinstance(value, (int, float))):
        return str(value)
    if not ONE_FIELD.fullmatch(fmt):
        refuse(f"a column format {fmt!r} is not one '{{:SPEC}}' field (a format is data)")
    try:
        return fmt.format(value)
    except ValueError as e:
        refuse(f"the column format {fmt!r} does not format {value!r}: {e}")


def render_table(name: str) -> Block:
    """A table (columns, formats, rows), or a tool's printed output (output: its lines) in a code block."""
    data = load(f"{name}.json")
    columns, rows = data.get("columns", []), data.get("rows", [])
    formats = data.get("formats") or [None] * len(columns)
    for i, row in enumerate([formats, *rows]):  # a cell more or less is never dropped silently
        if len(row) != len(columns):
            what = "its formats have" if i == 0 else f"its row {i - 1} has"
            refuse(f"results/{name}.json: {what} {len(row)} cells for {len(columns)} columns")
    cells = [[cell_text(v, f) for v, f in zip(row, formats)] for row in rows]
    body = ["```", *data["output"], "```"] if "output" in data else [markdown_table(columns, cells)]
    body += [line for note in data.get("notes", []) for line in ("", note)]
    return Block("\n".join([*provenance_lines(data["provenance"]), "", *body]), cells)


# --- one grid of a quality sweep: results/quality/SET/quality.json (lib/tables.py, tools/sweep.py's rows) ---


def row_commit(row: dict, sweep: dict) -> str:
    """The commits a row's seeds were trained at, short ('-dirty' kept; tools/sweep.py records them), else
    the sweep's provenance."""
    commits = {c[:7] + "-dirty" * c.endswith("-dirty") for c in row.get("commits") or [] if c}
    return "/".join(sorted(commits)) or sweep["commit"]


def commit_line(rows: list[dict], sweep: dict) -> str:
    """One commit for the whole comparison, or which rows came from which commit."""
    groups: dict[str, list[str]] = {}
    for row in rows:
        groups.setdefault(row_commit(row, sweep), []).append(row["cell"])
    if len(groups) == 1:
        return f"Every row trained at commit `{next(iter(groups))}`."
    return "**Rows trained at different commits** (compare across groups with care): " + "; ".join(
        f"`{commit}`: {', '.join(cells)}" for commit, cells in groups.items()) + "."


def render_quality(name: str) -> Block:
    grid = max((g for g in GRIDS if name.endswith("-" + g)), key=len)  # a grid's name may hold a dash
    sweep = load("quality-provenance.json")[name[len("quality-"):-len(grid) - 1]]
    rows = [r for r in load(sweep["file"])["rows"] if r["grid"] == grid]
    columns, cells = GRIDS[grid](rows)
    commits = [row_commit(r, sweep) for r in rows]
    minutes = sum(r["minutes"] for r in rows)
    parts = provenance_lines(dict(sweep, commit=", ".join(dict.fromkeys(commits))))
    parts += ["", markdown_table(columns, cells), "", commit_line(rows, sweep) +
              f" {minutes:.0f} training minutes for these rows; cells in `{sweep['cells']}`."]
    return Block("\n".join(parts), cells, commits)


# --- README's glance table: references into the other blocks ---


class Cells:
    """`{t[NAME][row][column]}` in a glance template is that cell of block NAME, rendered."""

    def __getitem__(self, name: str) -> list[list[str]]:
        return render(name).cells


CELL = re.compile(r"t\[([\w.-]+)\]\[(\d+)\]\[(\d+)\]")  # the one field a glance template may name


class Glance(string.Formatter):
    """Fills only named cells (a template is data: no attributes, conversions or other format specs);
    `{...:short}` drops what follows the first ' [' or ' (': '83.90 ± 0.36 [84.1 83.5]' -> '83.90 ± 0.36'."""

    def get_field(self, field_name, args, kwargs):
        match = CELL.fullmatch(field_name)
        if not match or match[1] == "glance" or match[1].startswith("line-"):  # never itself: no end
            refuse(f"results/glance.json: {{{field_name}}} is not a cell t[BLOCK][ROW][COLUMN] of a table")
        name, row, column = match[1], int(match[2]), int(match[3])
        cells = render(name).cells
        if row >= len(cells) or column >= len(cells[row]):
            refuse(f"results/glance.json: {{{field_name}}}: block {name} has no row {row}, column {column}")
        return cells[row][column], field_name

    def convert_field(self, value, conversion):
        if conversion is not None:
            refuse(f"results/glance.json: a conversion !{conversion} (only named cells are filled)")
        return value

    def format_field(self, value, spec: str) -> str:
        if spec not in ("", "short"):
            refuse(f"results/glance.json: the format spec {spec!r} (only :short)")
        return re.split(r" [\[(]", value)[0] if spec == "short" else value


def fill(template: str) -> str:
    return Glance().vformat(template, (), {"t": Cells()})


def render_glance(name: str) -> Block:
    """README's glance table, or (`line-KEY`) one of its sentences; a row whose numbers come from rows of one
    sweep trained at different commits says so."""
    data = load("glance.json")
    if name.startswith("line-"):
        return Block(fill(data["lines"][name[len("line-"):]]), [])
    cells = []
    for row in data["rows"]:
        used = {(source, render(source).row_commits[int(i)]) for source, i, _ in CELL.findall(row["result"])
                if render(source).row_commits}
        mixed = len(used) > len({source for source, _ in used})
        where = f"[{row['section']}](RESULTS.md#{row['anchor']})" + " (rows from different commits)" * mixed
        cells.append([row["what"], fill(row["result"]), where])
    return Block(markdown_table(data["columns"], cells), cells)


@functools.cache
def render(name: str) -> Block:
    kind = (render_glance if name == "glance" or name.startswith("line-") else
            render_quality if name.startswith("quality-") else render_table)
    return kind(name)


def rendered(text: str) -> str:
    """The document with every generated block rewritten from its data."""
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2)).text + "\n" + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    args = parser.parse_args(argv)
    texts = {document: Path(ROOT, document).read_text(encoding="utf-8") for document in DOCUMENTS}
    # every document rendered before any is written: a failure changes nothing
    stale = {document: rendered(text) for document, text in texts.items() if rendered(text) != text}
    if args.check and stale:
        print(f"out of date with results/*.json: {', '.join(stale)} (run: python results/render.py)")
        return 1
    for document, text in stale.items():
        tmp = Path(ROOT, f"{document}.tmp{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")  # then renamed: a kill leaves the old document
        os.replace(tmp, Path(ROOT, document))
    print(("up to date: " if args.check else "rendered: ") + ", ".join(DOCUMENTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
