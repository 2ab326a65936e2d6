"""bench/RESULTS.md's current tables against README's figures and the journal, bench/journal/ (issue 37).

- every benchmark figure README states (a number before t/s, x, GB/s, %, ms, us, s, points; fenced code left
  out) is in RESULTS.md's current tables, the part before its heading "## New entries", with the same unit;
- every link from RESULTS.md and from the journal's index to bench/journal/ names a file there and a heading
  of that file (GitHub's anchors: lowercase, punctuation dropped, spaces to '-', '-1', '-2' for repeats);
- every number in a table row of the current tables is one the journal entry the row links to states.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "RESULTS.md"
JOURNAL = ROOT / "bench" / "journal"
END_OF_TABLES = "## New entries"

# README figures that are settings or pass criteria, not measurements (the exact README text around them).
NOT_MEASURED = (
    "(0.15 ms: kernel launches and the router's one wait) is a default",
    "RSS growth under 5%",
)

_NUM = r"(?<![\w.])[~+\-−±]?\d[\d,]*(?:\.\d+)?"
_UNIT = r"(?:x\b|t/s|tok/s|tokens/s|GB/s|MB/s|%|ms\b|us\b|µs\b|s\b|points\b)"
FIGURE = re.compile(rf"((?:{_NUM})(?:\s*(?:-|–|to|/)\s*(?:{_NUM}))*)\s*({_UNIT})")
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?![\d])")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]*)\)")


def without_code(md: str) -> str:
    out, fence = [], False
    for line in md.splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        if not fence:
            out.append(line)
    return "\n".join(out)


def numbers(text: str) -> set[str]:
    """The numbers a text states, as written (thousands' commas dropped); digits inside a word (a3b, pp512,
    f34cb78, Q4_K) are not numbers."""
    return {m.group(0).replace(",", "") for m in NUMBER.finditer(text)}


def current_tables(md: str) -> str:
    assert END_OF_TABLES in md, f"RESULTS.md has no '{END_OF_TABLES}' heading ending its current tables"
    return md.split(END_OF_TABLES, 1)[0]


def readme_figures(md: str) -> list[tuple[str, str]]:
    """(figure as written, the README line) for each benchmark figure."""
    text = without_code(md)
    for phrase in NOT_MEASURED:
        text = text.replace(phrase, "")
    found = []
    for m in FIGURE.finditer(text):
        line = text[: m.start()].count("\n")
        found.append((m.group(0), text.splitlines()[line].strip()))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before de-duplication)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("**", "").strip()
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def headings(md: str) -> list[tuple[int, int, str]]:
    """(line index, level, anchor) of each heading outside fenced code, anchors de-duplicated as GitHub does."""
    seen: dict[str, int] = {}
    out, fence = [], False
    for i, line in enumerate(md.splitlines()):
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"(#{1,6}) (.*)", line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.append((i, len(m.group(1)), base if n == 0 else f"{base}-{n}"))
    return out


def entry(md: str, anchor: str) -> str | None:
    """The journal entry holding the heading with this anchor: its "## " section (a "### " anchor is part of
    one), with the file's opening paragraph (the machine every entry means unless it says otherwise)."""
    hs = headings(md)
    lines = md.splitlines()
    at = next((k for k, (_, _, a) in enumerate(hs) if a == anchor), None)
    if at is None:
        return None
    while at > 0 and hs[at][1] > 2:
        at -= 1
    start, level = hs[at][0], hs[at][1]
    end = next((i for i, lv, _ in hs[at + 1:] if lv <= level), len(lines))
    opening = next((i for i, lv, _ in hs if lv == 2), len(lines))
    return "\n".join(lines[:opening] + lines[start:end])


def journal_links(md: str, base: Path) -> list[tuple[str, Path, str]]:
    """(link as written, file, anchor) for each link into bench/journal/."""
    out = []
    for target in LINK.findall(md):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        file = (base / path).resolve() if path else None
        if file is not None and JOURNAL.resolve() in (file, *file.parents):
            out.append((target, file, anchor))
    return out


def figures(text: str) -> set[tuple[str, str]]:
    """(number, unit) of every figure in a text: '1.01-1.41x' gives ('1.01', 'x') and ('1.41', 'x')."""
    return {(n, unit(m.group(2))) for m in FIGURE.finditer(text) for n in numbers(m.group(1))}


def unit(u: str) -> str:
    return {"tok/s": "t/s", "tokens/s": "t/s", "µs": "us"}.get(u, u)


def test_readme_figures_are_in_the_current_tables():
    tables = figures(without_code(current_tables(RESULTS.read_text())))
    found = readme_figures(README.read_text())
    assert len(found) > 20, found  # the extraction still finds README's figures
    missing = []
    for figure, line in found:
        for n, u in sorted(figures(figure)):
            if (n, u) not in tables:
                missing.append(f"{n}{u} (in '{figure}': {line[:100]})")
    assert not missing, "README figures not in bench/RESULTS.md's current tables:\n" + "\n".join(missing)


def test_journal_links_resolve():
    results = RESULTS.read_text()
    links = journal_links(results, RESULTS.parent)
    assert len(links) > 20, links
    index = JOURNAL / "README.md"
    links += journal_links(index.read_text(), JOURNAL)
    bad = []
    for target, file, anchor in links:
        if not file.is_file():
            bad.append(f"{target}: no file {file.relative_to(ROOT)}")
        elif anchor and anchor not in {a for _, _, a in headings(file.read_text())}:
            bad.append(f"{target}: no heading with that anchor in {file.relative_to(ROOT)}")
    # links within RESULTS.md itself
    own = {a for _, _, a in headings(results)}
    for target in LINK.findall(results):
        if target.startswith("#") and target[1:] not in own:
            bad.append(f"{target}: no such heading in RESULTS.md")
    assert not bad, "\n".join(bad)


def test_every_table_figure_is_in_the_entry_it_links():
    tables = current_tables(RESULTS.read_text())
    lines = tables.splitlines()

    def separator(line: str) -> bool:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        return line.startswith("|") and all(re.fullmatch(r":?-+:?", c) for c in cells)

    bad, checked = [], 0
    for k, row in enumerate(lines):
        if not row.startswith("|") or separator(row):
            continue
        if k + 1 < len(lines) and separator(lines[k + 1]):
            continue  # a header row
        links = journal_links(row, RESULTS.parent)
        if not links:
            bad.append(f"a row without its journal entry: {row[:120]}")
            continue
        (_, file, anchor), *more = links
        assert not more, f"one entry per row: {row[:120]}"
        text = entry(file.read_text(), anchor) if file.is_file() else None
        if text is None:
            continue  # reported by test_journal_links_resolve
        stated = numbers(LINK.sub("", row))
        unknown = sorted(stated - numbers(text))
        if unknown:
            bad.append(f"{', '.join(unknown)} not in {file.name}#{anchor}: {row[:120]}")
        checked += 1
    assert checked > 20
    assert not bad, "\n".join(bad)
