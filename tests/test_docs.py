"""The documentation runs as written: every ```python block of README.md and docs/*.md.

The blocks of one page run in order in one fresh Python process (each block may use the names of the
ones before), from an empty folder, on the CPU, with a cache of their own (`TUNER_HOME` in a temporary
folder, so no user cache is read or written). A block that cannot run on a CPU says so on the line
right before its fence, and is left out:

    <!-- docs-test: skip: <reason> -->

Other fences (```bash, ```text, plain ```) are never run. A page whose python blocks cannot all be run
or skipped this way (an unknown `docs-test` comment, a `py`/`python3` fence, a skip with no reason), or
a README over README_MAX_LINES lines fails here.

What the pages cite is checked too, on these pages and on cache_db/README.md and benchmarks/**/*.md: a
relative link must name an existing file, and its `#anchor` a heading of that file (GitHub's anchors);
a script path (`benchmarks/<group>/<name>.py` or `.sh`, `examples/<name>.py`, `tests/<name>.py`) must exist.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITING = [*PAGES, ROOT / "cache_db" / "README.md", *sorted((ROOT / "benchmarks").rglob("*.md"))]
README_MAX_LINES = 220
PAGE_TIMEOUT_S = 300
NOTE = "The Python blocks on this page run in order, in one fresh process"  # each page with blocks says so

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
DIRECTIVE = re.compile(r"<!--\s*docs-test\b(?P<body>.*?)-->")
SKIP = re.compile(r"^:\s*skip:\s*(?P<reason>\S.*?)\s*$")
LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(?P<text>.+?)[ \t#]*$")
SCRIPT = re.compile(r"(?<![\w./-])(?:benchmarks/(?:\w[\w.-]*/)*\w[\w.-]*\.(?:py|sh)"
                    r"|(?:examples|tests)/(?:\w[\w.-]*/)*\w[\w.-]*\.py)(?!\w)")


@dataclass(frozen=True)
class Block:
    """One ```python block: its number among the page's python blocks (from 1), the line of its
    opening fence (from 1), its code, and why it is skipped (None: it runs)."""

    number: int
    line: int
    code: str
    skip: str | None


def parse(text: str) -> tuple[list[Block], list[str]]:
    """The python blocks of a markdown page, and what keeps any of them from being run or skipped."""
    lines = text.splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    directive: tuple[int, str] | None = None  # (line, skip reason) of a docs-test comment
    i = 0
    while i < len(lines):
        found = DIRECTIVE.search(lines[i])
        if found:
            if directive is not None:
                problems.append(f"line {directive[0]}: docs-test comment not right before a ```python fence")
            skip = SKIP.match(found["body"])
            if not skip or lines[i].strip() != found[0]:
                problems.append(f"line {i + 1}: unknown docs-test comment {lines[i].strip()!r} (the one form is "
                                f"'<!-- docs-test: skip: <reason> -->', alone on its line)")
                directive = None
            else:
                directive = (i + 1, skip["reason"])
            i += 1
            continue
        fence = FENCE.match(lines[i])
        if not fence:
            if directive is not None:
                problems.append(f"line {directive[0]}: docs-test comment not right before a ```python fence")
                directive = None
            i += 1
            continue
        opening, indent = fence["fence"], len(fence["indent"])
        words = fence["info"].split()
        language = words[0].lower() if words else ""
        end = i + 1
        while end < len(lines):
            closing = FENCE.match(lines[end])
            if closing and closing["fence"][0] == opening[0] and len(closing["fence"]) >= len(opening) \
                    and not closing["info"].strip():
                break
            end += 1
        if end == len(lines):
            problems.append(f"line {i + 1}: fence never closed")
        body = [line[indent:] if line[:indent].strip() == "" else line.lstrip() for line in lines[i + 1:end]]
        if language == "python" and len(words) == 1:
            blocks.append(Block(len(blocks) + 1, i + 1, "\n".join(body) + "\n",
                                directive[1] if directive is not None else None))
        elif language.startswith("py") or language in ("ipython", "pycon"):
            problems.append(f"line {i + 1}: a {fence['info'].strip()!r} block is neither run nor skipped: write "
                            f"```python (and a skip comment if it cannot run on a CPU)")
        elif directive is not None:
            problems.append(f"line {directive[0]}: docs-test comment before a {language or 'plain'} fence: only "
                            f"```python blocks are run or skipped")
        directive = None
        i = end + 1
    if directive is not None:
        problems.append(f"line {directive[0]}: docs-test comment not right before a ```python fence")
    return blocks, problems


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


# Runs one page's blocks in order in one namespace. Each block is compiled with the page as its file
# name and its own line numbers, so a traceback points at the page's line.
RUNNER = r"""
import json, sys, time, traceback
page, blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for block in blocks:
    code = "\n" * block["line"] + block["code"]
    start = time.monotonic()
    try:
        exec(compile(code, page, "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"docs-test: block {block['number']} (line {block['line']}) failed", file=sys.stderr)
        sys.exit(1)
    print(f"docs-test: block {block['number']} (line {block['line']}) ran in {time.monotonic() - start:.1f} s",
          file=sys.stderr, flush=True)
"""


def page_env(tmp_path: Path) -> dict[str, str]:
    """The environment a reader's fresh shell would have, on the CPU, with a cache of its own. The
    simulated device count is left to the page (its first block sets it, before jax is imported)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TUNER_DB", "TUNER_RECORD")}
    env.update(TUNER_HOME=str(tmp_path / "tuner-home"), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return env


def tiered(page: Path):
    """The README's blocks run in the fast tier; the docs pages' (about a minute together) in the full run."""
    return page if page.name == "README.md" and page.parent == ROOT else pytest.param(page, marks=pytest.mark.slow)


@pytest.mark.parametrize("page", [tiered(page) for page in PAGES], ids=page_id)
def test_the_python_blocks_of_the_page_run_as_written(page: Path, tmp_path: Path):
    """The page's python blocks, minus the skipped ones, run in order in one fresh process."""
    blocks, _ = parse(page.read_text(encoding="utf-8"))
    runnable = [b for b in blocks if b.skip is None]
    if not runnable:
        return  # nothing on this page runs (its python blocks, if any, say why they are skipped)
    work = tmp_path / "cwd"
    work.mkdir()
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps([str(page), [b.__dict__ for b in runnable]]))
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-c", RUNNER, str(spec)], cwd=work, env=page_env(tmp_path),
                              capture_output=True, text=True, timeout=PAGE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-3000:]
        pytest.fail(f"{page_id(page)}: its blocks ran over {PAGE_TIMEOUT_S} s; stderr tail:\n"
                    f"{tail.decode(errors='replace') if isinstance(tail, bytes) else tail}")
    ran = [line for line in proc.stderr.splitlines() if line.startswith("docs-test: block") and " ran in " in line]
    if proc.returncode != 0:
        failed = runnable[len(ran)] if len(ran) < len(runnable) else None
        where = f"block {failed.number} (line {failed.line})" if failed else "after its last block"
        pytest.fail(f"{page_id(page)}: python {where} failed (exit {proc.returncode}); stderr tail:\n"
                    f"{proc.stderr[-4000:]}", pytrace=False)
    assert len(ran) == len(runnable), proc.stderr[-4000:]
    print(f"{page_id(page)}: {len(runnable)} block(s) in {time.monotonic() - start:.1f} s:", *ran, sep="\n  ")


def test_every_python_block_can_be_run_or_is_skipped_with_a_reason():
    """No python block is left out silently: each is a plain ```python block, run or skipped by the one
    comment form with its reason, and each page with blocks says at its top how they run."""
    problems = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        blocks, found = parse(text)
        problems += [f"{page_id(page)}: {p}" for p in found]
        if blocks and NOTE not in text:
            problems.append(f"{page_id(page)}: has python blocks but does not say how they run ({NOTE!r} ...)")
    assert not problems, "\n".join(problems)


def test_the_block_check_catches_what_cannot_run():
    """The parser itself: a skip runs nothing and keeps its reason; each way of leaving a block neither
    run nor skipped is reported."""
    good = "# Page\n\n```python\nx = 1\n```\n\n<!-- docs-test: skip: needs a GPU -->\n```python\ny = 2\n```\n" \
           "```bash\necho\n```\n"
    blocks, problems = parse(good)
    assert problems == [] and [(b.number, b.line, b.skip) for b in blocks] == [(1, 3, None), (2, 8, "needs a GPU")]
    assert blocks[0].code == "x = 1\n"
    bad = ["<!-- docs-test: run-later -->\n```python\nx\n```\n", "```py\nx\n```\n", "```python3\nx\n```\n",
           "<!-- docs-test: skip: -->\n```python\nx\n```\n", "<!-- docs-test: skip: why -->\n```bash\nx\n```\n",
           "<!-- docs-test: skip: why -->\ntext\n```python\nx\n```\n",
           "<!-- docs-test: skip: why -->\n\n```python\nx\n```\n", "```python\nx\n"]
    for text in bad:
        assert parse(text)[1], text


def anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings (fenced code left out): lowercase, punctuation but `-` and `_`
    dropped, spaces to `-`; a repeated anchor gets `-1`, `-2`, ..."""
    found: set[str] = set()
    fence = None
    for line in text.splitlines():
        opening = FENCE.match(line)
        if opening and (fence is None or (opening["fence"][0] == fence[0] and len(opening["fence"]) >= len(fence)
                                          and not opening["info"].strip())):
            fence = opening["fence"] if fence is None else None
            continue
        heading = HEADING.match(line) if fence is None else None
        if heading:
            anchor = re.sub(r"[^\w\- ]", "", heading["text"].lower()).replace(" ", "-")
            count = 0
            while (unique := anchor if count == 0 else f"{anchor}-{count}") in found:
                count += 1
            found.add(unique)
    return found


def citation_problems(page: Path) -> list[str]:
    """The page's relative links to a missing file or heading, and its script paths that do not exist."""
    text = page.read_text(encoding="utf-8")
    problems = []
    for match in LINK.finditer(text):
        target = match["target"]
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"link to a missing file: {target}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text(encoding="utf-8")):
            problems.append(f"link to a missing heading: {target}")
    problems += [f"no such script: {path}" for path in sorted(set(SCRIPT.findall(text))) if not (ROOT / path).exists()]
    return problems


def test_what_the_pages_cite_exists():
    """Every relative link of the pages names an existing file (and heading), every script path a script."""
    problems = [f"{page_id(page)}: {problem}" for page in CITING for problem in citation_problems(page)]
    assert not problems, "\n".join(problems)


def test_the_citation_check_catches_what_is_missing(tmp_path: Path):
    """The checker itself: a missing file, a missing heading and a missing script are each reported; a
    heading's anchor drops punctuation, a repeated one is numbered, and a `#` line in a fence is no heading."""
    (tmp_path / "other.md").write_text("# Other\n\n## `tuner search`: A, b (2026)\n\n## Twice\n\n## Twice\n\n"
                                       "```bash\n# Not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[a](other.md#tuner-search-a-b-2026) [b](other.md#twice-1) [c](#page) [d](other.md)\n"
                    "`python tests/test_docs.py` and `examples/long_context_lm.py`\n")
    assert citation_problems(page) == []
    page.write_text("[a](gone.md) [b](other.md#twice-2) [c](other.md#not-a-heading) [d](#nowhere)\n\n"
                    "```bash\npython benchmarks/nowhere/gone.py --help\nbash benchmarks/gone.sh\n```\n")
    assert citation_problems(page) == [
        "link to a missing file: gone.md", "link to a missing heading: other.md#twice-2",
        "link to a missing heading: other.md#not-a-heading", "link to a missing heading: #nowhere",
        "no such script: benchmarks/gone.sh", "no such script: benchmarks/nowhere/gone.py"]


def test_the_readme_fits_a_first_read():
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to a page under docs/"
