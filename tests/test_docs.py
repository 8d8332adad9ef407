"""The README is the first page and docs/ the reference: every relative link (and #anchor) in
README.md and docs/*.md leads somewhere, the README stays about a page long, and the minimal
configuration it shows is one hal0d accepts."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from hal0d import config as configuration

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)


def prose(path: Path) -> str:
    """The page without its code blocks (a `[x](y)` in a shell example is no link)."""
    return FENCE.sub("", path.read_text())


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(prose(path)):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    return [target for target in LINK.findall(prose(path))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: are out


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        if not resolved.exists():
            broken.append(f"{target}: no {resolved.relative_to(REPO)}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_link_check_finds_a_broken_link_and_a_broken_anchor(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A page\n\n[ok](#a-page) [gone](b.md) [lost](#nowhere)\n")
    page = tmp_path / "a.md"
    assert links(page) == ["#a-page", "b.md", "#nowhere"]
    assert anchors(page) == {"a-page"}
    assert slug("`[[slots]]` (one table per upstream)") == "slots-one-table-per-upstream"


def test_the_readme_is_a_first_page_and_every_docs_page_is_linked_from_it() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert readme.index("make run") < readme.index("\n## ")  # the two commands come first
    linked = {target.partition("#")[0] for target in links(REPO / "README.md")}
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in linked, f"README.md does not link docs/{page.name}"


def test_the_readmes_minimal_llama_server_config_is_one_hal0d_accepts(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    block = readme.split("\n## Your own models\n", 1)[1].split("```toml\n", 1)[1]
    raw = tomllib.loads(block.split("```", 1)[0])
    parsed = configuration.parse(raw, base_dir=tmp_path)
    [slot] = parsed.slots
    assert slot.command is not None and slot.command[0] == "llama-server"
    assert slot.upstream.endswith(slot.command[slot.command.index("--port") + 1])


def test_the_status_pages_size_in_the_docs_is_its_size_and_it_stays_small() -> None:
    total = sum(path.stat().st_size for path in (REPO / "hal0d" / "static").iterdir())
    kb = f"{round(total / 1000)} KB in all"
    for page in (REPO / "README.md", REPO / "docs" / "endpoints.md"):
        assert kb in page.read_text().replace("\n", " "), (page.name, kb)
    # 60 KB until the Groups cards (groups.js, ~5 KB) came, 65 KB until the Devices section
    # (devices.js, ~9 KB), 80 KB until the Keys section (keys.js, ~7 KB), 90 KB until app.js
    # became a module per concern (their headers and imports, ~4 KB): still one small read of a
    # page.
    assert total < 95_000
