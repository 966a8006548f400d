"""The README and docs/ pages: every relative link leads to a file that exists, and
every #anchor to a heading of that file (GitHub's slugs); the README stays a front door."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"(?ms)^```.*?^```", "", page.read_text())  # headings only, not code
    return {slug(h) for h in re.findall(r"(?m)^#{1,6} (.+)$", text)}


def links(page: Path) -> list[str]:
    text = re.sub(r"(?ms)^```.*?^```", "", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_every_relative_link_and_anchor_exists():
    broken = []
    for page in PAGES:
        for href in links(page):
            if re.match(r"[a-z]+:", href):  # https:, mailto:
                continue
            path, _, anchor = href.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {href} (no {path})")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                broken.append(f"{page.relative_to(ROOT)}: {href} (no heading #{anchor} in {path or page.name})")
    assert not broken, "\n".join(broken)


def test_the_link_check_finds_a_broken_link_and_a_missing_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# A\n\n## Two words\n\n[ok](#two-words) [gone](b.md) [no anchor](a.md#three)\n")
    page = tmp_path / "a.md"
    found = [h for h in links(page) if not (page.parent / h.partition("#")[0]).exists() or (h.partition("#")[2] and h.partition("#")[2] not in anchors(page))]
    assert found == ["b.md", "a.md#three"]


def test_the_readme_is_a_front_door():
    """At most 300 lines; its first two indented commands are the set-up commands
    (.ci/run runs the second); every docs page is linked from it."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    commands = re.findall(r"(?m)^    (\S.*)$", text)
    assert commands[0].endswith("aotc run artifacts/tiny --check --max-batch 3") and "pip install torch==2.13.0" in commands[0]
    assert commands[1].endswith("python -m pytest -q") and commands[1] in (ROOT / ".ci" / "run").read_text()
    linked = {h.partition("#")[0] for h in links(ROOT / "README.md")}
    assert {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} <= linked
