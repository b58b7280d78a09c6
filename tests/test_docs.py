"""The docs hold together: every relative markdown link in README.md and docs/*.md points at a
file (and heading) that exists; every `src/`, `conf/`, `tests/`, `bench/`, `examples/`, `docs/`
and `.ci/` path they name exists; docs/architecture.md's layout names every module of
src/gradsync/ and bench/, and only modules that exist; docs/configuration.md's table names every
group of conf/ and its options; README.md stays a front door (at most 120 lines); every number
a page quotes from a command is marked as measured on a named date or checked by a named test
(`quote_problems`). Reads files only: no process."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 120

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# a repository path: starts at a word boundary that is not inside another path
PATH = re.compile(r"(?<![\w./<-])((?:src|conf|tests|bench|examples|docs|\.ci)/[\w./*-]*[\w*])")
# a module named from inside the package, as docs/architecture.md does: run/main.py
PACKAGE_PATH = re.compile(r"(?<![\w./<-])((?:config|run|train|sync|engines|data)/\w+\.py)\b")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def doc_files(repo: Path = REPO) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


# --- numbers quoted from commands ----------------------------------------------------------------
# A quote: a table, an output block (a fence without a language) or a paragraph holding at least
# QUOTE_NUMBERS measured-looking numbers (3 significant digits or more: 0.0714, 12.6, 7,134).
# Each must be marked, in its section (from its heading down to it), as measured on a named
# date (any YYYY-MM-DD: "measured 2026-12-06", a bench/results/<date> file), checked by a test
# (<!-- checked by tests/<file>.py::<test> -->: the test exists and reads this page, so it
# regenerates what the page quotes), or as no measurement (<!-- not measured: <why> -->:
# versions, sizes that follow from a config). A number that drifts is then either caught by
# its test or dated, never silently current.
QUOTE_NUMBERS = 3
NUMBER = re.compile(r"(?<![\w.\-/])(\d[\d,]*\.\d+|\d{1,3}(?:,\d{3})+)(?![\w.]*\d)")
DATED = re.compile(r"\d{4}-\d{2}-\d{2}|<!-- not measured: [^>]+ -->")
CHECKED = re.compile(r"<!-- checked by (tests/[\w/]+\.py)::(\w+) -->")


def measured_numbers(text: str) -> list[str]:
    return [n for n in NUMBER.findall(text)
            if len(n.replace(",", "").replace(".", "").lstrip("0")) >= 3]


def quotes(text: str) -> list[tuple[int, list[str], list[str]]]:
    """(line, the quote's lines, its section's lines up to and including it: its own heading's
    and those of the headings above it) of every quote."""
    lines, out, i = text.splitlines(), [], 0
    stack: list[tuple[int, list[str]]] = [(0, [])]  # (heading level, its lines so far)
    while i < len(lines):
        line, j = lines[i], i + 1
        if line.startswith(("```", "~~~")):
            while j < len(lines) and not lines[j].startswith(line[:3]):
                j += 1
            unit = lines[i + 1:j] if not line[3:].strip() or line[3:].strip() == "text" else []
            j += 1
        elif line.startswith("|"):
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            unit = lines[i:j]
        elif m := HEADING.match(line):
            level = len(m.group(1))
            while stack and stack[-1][0] >= level:
                stack.pop()
            stack.append((level, [line]))
            i = j
            continue
        elif not line.strip():
            i = j
            continue
        else:
            while j < len(lines) and lines[j].strip() and not lines[j].startswith(("```", "|")):
                j += 1
            unit = lines[i:j]
        stack[-1][1].extend(lines[i:j])
        if len(measured_numbers("\n".join(unit))) >= QUOTE_NUMBERS:
            # a page's title section dates only what stands in it, not the whole page
            out.append((i + 1, unit, [x for level, part in stack
                                      if level > 1 or part is stack[-1][1] for x in part]))
        i = j
    return out


def quote_problems(md: Path, repo: Path = REPO) -> tuple[list[str], int]:
    """(the quotes of md neither dated nor checked, how many quotes it holds); a checker that
    is not a test of a file that reads this page is a problem too."""
    bad, name = [], md.relative_to(repo).as_posix()
    found = quotes(md.read_text())
    for line, _, section in found:
        scope = "\n".join(section)
        checks = CHECKED.findall(scope)
        for file, test in checks:
            source = repo / file
            text = source.read_text() if source.is_file() else ""
            if f"def {test}(" not in text or md.name not in text:
                bad.append(f"{name}:{line}: {file}::{test} is no test reading {md.name}")
        if not checks and not DATED.search(scope):
            bad.append(f"{name}:{line}: numbers quoted without a date or a checking test")
    return bad, len(found)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(FENCE.sub("", md.read_text())):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def problems(md: Path, repo: Path = REPO) -> tuple[list[str], int]:
    """(what is broken in md, how many links and paths were checked)."""
    text = md.read_text()
    name = md.relative_to(repo).as_posix()
    bad: list[str] = []
    checked = 0
    for m in LINK.finditer(FENCE.sub("", text)):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        checked += 1
        file_part, _, anchor = target.partition("#")
        dest = (md.parent / file_part).resolve() if file_part else md
        if not dest.exists():
            bad.append(f"{name}: link {target}: no file {file_part}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{name}: link {target}: no heading #{anchor} in {file_part or name}")
    for m in PATH.finditer(text):
        path = m.group(1).rstrip(".")
        checked += 1
        if not (any(repo.glob(path)) if "*" in path else (repo / path).exists()):
            bad.append(f"{name}: path {path} does not exist")
    for m in PACKAGE_PATH.finditer(text):
        checked += 1
        if not (repo / "src" / "gradsync" / m.group(1)).exists():
            bad.append(f"{name}: path {m.group(1)} does not exist in src/gradsync/")
    return bad, checked


def layout_problems(repo: Path = REPO) -> tuple[list[str], int]:
    """Modules docs/architecture.md's layout tables name that do not exist, and modules of
    src/gradsync/ (each folder and the top level) and bench/ that they leave out; dunder files
    aside. Returns (problems, modules named)."""
    text = (repo / "docs" / "architecture.md").read_text()
    folders = {"top level": repo / "src" / "gradsync", "`bench/`": repo / "bench"}
    for sub in sorted((repo / "src" / "gradsync").iterdir()):
        if (sub / "__init__.py").exists():
            folders[f"`{sub.name}/`"] = sub
    bad: list[str] = []
    named_total = 0
    for cell, folder in folders.items():
        rows = [line for line in text.splitlines() if line.startswith(f"| {cell} |")]
        where = folder.relative_to(repo).as_posix()
        if not rows:
            bad.append(f"docs/architecture.md: no layout row for {where}/")
            continue
        named = {m for m in re.findall(r"`(\w+\.py)`", rows[0]) if not m.startswith("__")}
        named_total += len(named)
        present = {f.name for f in folder.glob("*.py") if not f.name.startswith("__")}
        bad += [f"docs/architecture.md names {where}/{m}, which does not exist"
                for m in sorted(named - present)]
        bad += [f"docs/architecture.md's layout leaves out {where}/{m}"
                for m in sorted(present - named)]
    return bad, named_total


def group_problems(repo: Path = REPO) -> tuple[list[str], int]:
    """docs/configuration.md's table of groups against conf/: one row per group folder, its
    options exactly the folder's YAML files. Returns (problems, options named)."""
    rows = {}
    for line in (repo / "docs" / "configuration.md").read_text().splitlines():
        m = re.match(r"\| `(\w+)/` \| ([^|]*) \|", line)
        if m:
            rows[m.group(1)] = set(re.findall(r"`(\w+)`", m.group(2)))
    groups = {d.name for d in (repo / "conf").iterdir() if d.is_dir() and d.name != "hydra"}
    bad = [f"docs/configuration.md: no row for conf/{g}/" for g in sorted(groups - set(rows))]
    bad += [f"docs/configuration.md: a row for conf/{g}/, which does not exist"
            for g in sorted(set(rows) - groups)]
    for g in sorted(groups & set(rows)):
        have = {f.stem for f in (repo / "conf" / g).glob("*.yaml")}
        bad += [f"docs/configuration.md: conf/{g}/ has no option {o}"
                for o in sorted(rows[g] - have)]
        bad += [f"docs/configuration.md: conf/{g}/{o}.yaml missing from its row"
                for o in sorted(have - rows[g])]
    return bad, sum(len(v) for v in rows.values())


def test_the_configuration_table_lists_every_group_and_option():
    bad, named = group_problems()
    assert bad == []
    assert named >= 30


def test_every_link_and_path_in_the_docs_exists():
    found: list[str] = []
    checked = 0
    for md in doc_files():
        bad, n = problems(md)
        found += bad
        checked += n
    assert found == []
    assert len(doc_files()) >= 20
    assert checked >= 200  # the checker saw the docs' links and paths, not an empty set


def test_the_architecture_layout_names_every_module_that_exists():
    bad, named = layout_problems()
    assert bad == []
    assert named >= 60


def test_every_number_quoted_from_a_command_is_dated_or_checked():
    found: list[str] = []
    quoted = 0
    for md in [*doc_files(), *sorted((REPO / "examples").glob("*/README.md"))]:
        bad, n = quote_problems(md)
        found += bad
        quoted += n
    assert found == []
    assert quoted >= 40  # the checker saw the docs' tables and numbers, not an empty set


def test_an_undated_or_unchecked_quote_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_reads(): open('docs/a.md')\n")
    md = tmp_path / "docs" / "a.md"
    md.write_text("# A\n\nIt ended at 0.0714, 0.0749 and 7,134 samples/s.\n\n"
                  "## Dated (measured 2026-12-06)\n\n| N | loss |\n|---|---|\n"
                  "| 1 | 0.0714 |\n| 2 | 0.0707 |\n| 4 | 0.0828 |\n\n"
                  "## Checked\n\n<!-- checked by tests/test_a.py::test_reads -->\n\n```\n"
                  "steps=360 loss=0.0100 eval=0.0828 acc=0.9749\n```\n\n"
                  "## Checked by nothing\n\n<!-- checked by tests/test_a.py::test_gone -->\n"
                  "0.123 0.456 0.789\n\n"
                  "## Versions\n\ntorch 2.11, 2.13 and 2.14 <!-- not measured: versions -->\n"
                  "\nA config's 0.95, 1e-3 and 100 are no measurement.\n")
    bad, n = quote_problems(md, tmp_path)
    assert n == 5
    assert bad == ["docs/a.md:3: numbers quoted without a date or a checking test",
                   "docs/a.md:23: tests/test_a.py::test_gone is no test reading a.md"]


def test_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_a_broken_link_or_path_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "here.py").write_text("")
    (tmp_path / "docs" / "b.md").write_text("# B page\n\n## Two `words`, here\n")
    md = tmp_path / "docs" / "a.md"
    md.write_text(
        "# A\n\n[ok](b.md) [ok](b.md#two-words-here) [ok](#a) [web](https://x.org/y)\n"
        "[gone](c.md) [no heading](b.md#three) `src/here.py` and `src/gone.py`, "
        "`src/*.py` `tests/none_*.py` `run/gone.py` `src/run/here.py`\n\n"
        "```\n[in code](nowhere.md)\n# not a heading\n```\n"
        "[not an anchor](#not-a-heading)\n"
    )
    bad, checked = problems(md, tmp_path)
    assert bad == [
        "docs/a.md: link c.md: no file c.md",
        "docs/a.md: link b.md#three: no heading #three in b.md",
        "docs/a.md: link #not-a-heading: no heading #not-a-heading in docs/a.md",
        "docs/a.md: path src/gone.py does not exist",
        "docs/a.md: path tests/none_*.py does not exist",
        "docs/a.md: path src/run/here.py does not exist",
        "docs/a.md: path run/gone.py does not exist in src/gradsync/",
    ]
    # 6 relative links, 5 paths, 1 package path; the web link and the fenced one skipped
    assert checked == 12


def _files(root: Path, paths: list[str], text: str = "") -> None:
    for path in paths:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


def test_a_module_missing_from_the_layout_is_found(tmp_path):
    _files(tmp_path / "src" / "gradsync", [
        "__init__.py", "models.py", "run/__init__.py", "run/main.py", "run/new.py",
        "run/__main__.py", "train/__init__.py", "bench_not_here/x.py"])
    _files(tmp_path, ["bench/run.py"])
    _files(tmp_path, ["docs/architecture.md"],
           "| `run/` | `main.py`, `gone.py`, `__main__.py` | ? |\n"
           "| top level | `models.py` | ? |\n| `bench/` | `run.py` (harness) | |\n")
    bad, named = layout_problems(tmp_path)
    assert bad == [
        "docs/architecture.md names src/gradsync/run/gone.py, which does not exist",
        "docs/architecture.md's layout leaves out src/gradsync/run/new.py",
        "docs/architecture.md: no layout row for src/gradsync/train/",
    ]
    assert named == 4  # main.py, gone.py, models.py, bench/run.py; bench_not_here/ is no package


def test_the_readme_policy_is_a_policy():
    """README's policy of one's own, as written there: its one method and the YAML naming it."""
    text = (REPO / "README.md").read_text()
    code = re.search(r"```python\n(# (\w+)\.py[^\n]*\n.*?)```", text, re.S)
    assert code is not None
    namespace: dict[str, object] = {}
    exec(compile(code.group(1), "README.md", "exec"), namespace)
    yaml = re.search(r"printf '_target_: ([\w.]+)\\nk: (\d+)\\n' > \S+/sync/(\w+)\.yaml", text)
    assert yaml is not None
    module, cls = yaml.group(1).rsplit(".", 1)
    assert module == code.group(2)
    assert f"sync={yaml.group(3)}" in text
    policy = namespace[cls](k=int(yaml.group(2)))  # type: ignore[operator]
    assert [m for m in range(8) if policy.should_sync(m, 8)] == [1, 3, 5, 7]
    assert [m for m in range(3) if policy.should_sync(m, 3)] == [1, 2]  # the last always syncs
    assert [m for m in range(1) if policy.should_sync(m, 1)] == [0]


def test_a_group_or_option_missing_from_the_table_is_found(tmp_path):
    _files(tmp_path / "conf", ["model/mlp.yaml", "model/cnn.yaml", "engine/ddp.yaml",
                               "hydra/x/y.yaml", "config.yaml"])
    _files(tmp_path, ["docs/configuration.md"],
           "| group | options | keys |\n|---|---|---|\n"
           "| `model/` | `mlp`, `gone` | `hidden_sizes` |\n| `old/` | `a` | |\n")
    bad, named = group_problems(tmp_path)
    assert bad == [
        "docs/configuration.md: no row for conf/engine/",
        "docs/configuration.md: a row for conf/old/, which does not exist",
        "docs/configuration.md: conf/model/ has no option gone",
        "docs/configuration.md: conf/model/cnn.yaml missing from its row",
    ]
    assert named == 3  # mlp, gone, a
