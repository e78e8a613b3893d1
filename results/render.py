"""Write the measured tables of RESULTS.md (and README.md's glance table) from the JSON beside this file.

    python results/render.py           # rewrite every generated block in place
    python results/render.py --check   # exit 1 when a block differs from its data (tests/test_results.py)

A generated block is the text between `<!-- generated: NAME -->` and `<!-- end -->`. NAME says
where its data is:
- `quality-SET-GRID`: one grid of a quality sweep (`python -m tools.sweep`, which prints the same tables);
  SET names a sweep in quality-provenance.json here (its quality.json, and the provenance for rows that
  do not record their commit);
- `glance` / `line-KEY`: README's results-at-a-glance table / one of its sentences (results/glance.json),
  each number a reference to a cell of another block;
- any other NAME: the table results/NAME.json, with its provenance {command, hardware, torch, date,
  commit}, written as measured.
Every block ends with where its numbers come from; a comparison whose rows were trained at different
commits says so. The data is read as data: nothing non-finite, no row longer or shorter than its
columns, a format string of one field; every document renders before any is written. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import string
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DOCUMENTS = ("RESULTS.md", "README.md")
BLOCK = re.compile(r"(<!-- generated: ([\w.-]+) -->\n)(.*?)(<!-- end -->)", re.S)

sys.path.insert(0, ROOT)  # the project's lib/ (run as python results/render.py, its folder is on the path)
from lib.tables import GRIDS, markdown_table  # noqa: E402  (the sweep's tables, stdlib only)


def refuse(what: str):
    raise SystemExit(f"results/render.py: {what}")


def load(name: str):
    path = os.path.join(HERE, name)
    if not os.path.exists(path):
        refuse(f"a generated block names {name!r}, but results/{name} does not exist")
    try:
        with open(path, encoding="utf-8") as f:  # nothing non-finite is rendered ("nan%")
            return json.load(f, parse_constant=finite, parse_float=finite)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # torn, edited, not JSON
        refuse(f"results/{name} is not readable JSON ({type(e).__name__}: {' '.join(str(e).split())[:160]}); "
               f"restore it from git or rerun its command")


def finite(text: str) -> float:
    """A JSON number as render takes it: finite (NaN, Infinity and 1e400 are refused where they are read)."""
    if not math.isfinite(float(text)):
        raise ValueError(f"{text} is not a finite number")
    return float(text)


def provenance_lines(p: dict) -> list[str]:
    """'Measured DATE at commit C on HARDWARE, torch T:' and the command(s) that measured the table."""
    commits = p["commit"].split(", ")
    named = ", ".join(f"`{c}`" for c in commits)
    lines = [f"Measured {p['date']} at commit{'s' * (len(commits) > 1)} {named} on {p['hardware']}, "
             f"torch {p['torch']}" + (f"; {p['note']}" if p.get("note") else "") + ":"]
    commands = p["command"] if isinstance(p["command"], list) else [p["command"]]
    return lines + ["", "```bash", *commands, "```"]


class Block:
    """A rendered block: its markdown, its table's cells (for references), a sweep's commit of each row."""

    def __init__(self, text: str, cells: list[list[str]], row_commits: list[str] | None = None):
        self.text, self.cells, self.row_commits = text, cells, row_commits


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
    if "output" in data:
        output = ["", "```", *data["output"], "```"]
        return Block("\n".join(provenance_lines(data["provenance"]) + output), [])
    columns = data["columns"]
    formats = data.get("formats") or [None] * len(columns)
    for i, row in enumerate([formats, *data["rows"]]):  # a cell more or less is never dropped silently
        if len(row) != len(columns):
            what = "its formats have" if i == 0 else f"its row {i - 1} has"
            refuse(f"results/{name}.json: {what} {len(row)} cells for {len(columns)} columns")
    cells = [[cell_text(v, f) for v, f in zip(row, formats)] for row in data["rows"]]
    parts = provenance_lines(data["provenance"]) + ["", markdown_table(columns, cells)]
    parts += [line for note in data.get("notes", []) for line in ("", note)]
    return Block("\n".join(parts), cells)


# --- one grid of a quality sweep: results/quality/SET/quality.json (lib/tables.py, tools/sweep.py's rows) ---


def short_commit(commit: str) -> str:
    """git's short form of a full hash sweep.py records ('-dirty' kept): 'b3a91df699ae...' -> 'b3a91df'."""
    match = re.fullmatch(r"([0-9a-f]{40})(-dirty)?", commit or "")
    return match[1][:7] + (match[2] or "") if match else commit


def row_commit(row: dict, sweep: dict) -> str:
    """The commit a row was trained at: its own record (sweep.py writes it), else the sweep's provenance."""
    if row.get("commit"):
        return short_commit(row["commit"])
    if row.get("commits"):
        return "/".join(sorted({short_commit(c) for c in row["commits"]}))
    return sweep.get("commit_of_cell", {}).get(f"{row['grid']}/{row['cell']}", sweep["commit"])


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
    set_name = name[len("quality-"):-len(grid) - 1]
    sweep = load("quality-provenance.json")[set_name]
    result = load(sweep["file"])
    rows = [r for r in result["rows"] if r["grid"] == grid]
    columns, cells = GRIDS[grid](rows)
    minutes = sum(r["minutes"] for r in rows)
    p = dict(sweep, commit=", ".join(dict.fromkeys(row_commit(r, sweep) for r in rows)))
    parts = provenance_lines(p) + ["", markdown_table(columns, cells), "", commit_line(rows, sweep) + (
        f" {minutes:.0f} training minutes for these rows; cells in `{sweep['cells']}`.")]
    return Block("\n".join(parts), cells, row_commits=[row_commit(r, sweep) for r in rows])


# --- README's glance table: references into the other blocks ---


class Cells:
    """`{t[NAME][row][column]}` in a glance template is that cell of block NAME, rendered."""

    def __getitem__(self, name: str) -> list[list[str]]:
        return render(name).cells


CELL = re.compile(r"t\[([\w.-]+)\]\[(\d+)\]\[(\d+)\]")  # the one field a glance template may name


class Glance(string.Formatter):
    """Fills only named cells, `{t[NAME][row][column]}` (a template is data: no attribute or other index
    lookups, no conversions, no format specs but `short`). `{...:short}` drops what follows the first ' ['
    or ' (': '83.90 ± 0.36 [84.1 84.1 83.5]' -> '83.90 ± 0.36'."""

    def get_field(self, field_name, args, kwargs):
        match = CELL.fullmatch(field_name)
        if not match or match.group(1) == "glance" or match.group(1).startswith("line-"):
            refuse(f"results/glance.json: {{{field_name}}} is not a cell t[BLOCK][ROW][COLUMN] of a table")
        name, row, column = match.group(1), int(match.group(2)), int(match.group(3))
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


def render_glance(name: str) -> Block:
    """A row whose numbers come from rows of one sweep trained at different commits says so."""
    data = load("glance.json")
    cells = []
    for row in data["rows"]:
        commits: dict[str, set] = {}
        for source, index in re.findall(r"\{t\[([\w.-]+)\]\[(\d+)\]", row["result"]):
            if render(source).row_commits:
                commits.setdefault(source, set()).add(render(source).row_commits[int(index)])
        mixed = any(len(found) > 1 for found in commits.values())
        where = f"[{row['section']}](RESULTS.md#{row['anchor']})" + " (rows from different commits)" * mixed
        cells.append([row["what"], Glance().vformat(row["result"], (), {"t": Cells()}), where])
    return Block(markdown_table(data["columns"], cells), cells)


def render_line(name: str) -> Block:
    """`line-KEY`: one sentence of README, its numbers referenced like the glance table's."""
    return Block(Glance().vformat(load("glance.json")["lines"][name[len("line-"):]], (), {"t": Cells()}), [])


_cache: dict[str, Block] = {}


def render(name: str) -> Block:
    if name not in _cache:
        kind = (render_glance if name == "glance" else render_line if name.startswith("line-") else
                render_quality if name.startswith("quality-") else render_table)
        _cache[name] = kind(name)
    return _cache[name]


def rendered(text: str) -> str:
    """The document with every generated block rewritten from its data."""
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2)).text + "\n" + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    args = parser.parse_args(argv)
    texts, new = {}, {}
    for document in DOCUMENTS:  # every document rendered before any is written: a failure changes nothing
        with open(os.path.join(ROOT, document), encoding="utf-8") as f:
            texts[document] = f.read()
        new[document] = rendered(texts[document])
    stale = [document for document in DOCUMENTS if new[document] != texts[document]]
    for document in stale if not args.check else ():
        path = os.path.join(ROOT, document)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:  # atomic: a kill leaves the old document
            f.write(new[document])
        os.replace(tmp, path)
    if args.check and stale:
        print(f"out of date with results/*.json: {', '.join(stale)} (run: python results/render.py)")
        return 1
    print(("up to date: " if args.check else "rendered: ") + ", ".join(DOCUMENTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
