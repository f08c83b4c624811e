"""The README and docs/: the README stays short, every link inside the repository resolves, and
every result file they link records the commit and the CPU it ran on."""

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def links(page: Path) -> list[tuple[Path, str]]:
    """(target file, anchor) of each relative link of the page that stays inside the repo."""
    out = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if resolved.is_relative_to(REPO):
            out.append((resolved, anchor))
    return out


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces to -."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_readme_is_short_and_links_the_docs() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) < 20_000
    for page in ("architecture", "api", "operations", "faults", "kernels", "benchmarks", "models"):
        assert f"(docs/{page}.md)" in readme, page
    assert "make run" in readme and "make test" in readme
    assert "not run on a GPU" in readme


def test_every_link_inside_the_repository_resolves() -> None:
    checked = 0
    for page in PAGES:
        for target, anchor in links(page):
            assert target.exists(), f"{page.name}: {target.relative_to(REPO)} does not exist"
            if anchor and target.suffix == ".md":
                assert anchor in anchors(target), f"{page.name}: no #{anchor} in {target.name}"
            checked += 1
    assert checked >= 20


def test_every_linked_result_file_records_its_commit_and_cpu() -> None:
    results = {t for page in PAGES for t, _ in links(page) if t.parent.name == "results"}
    assert results, "the README links no result file"
    for path in results:
        if path.suffix != ".json":
            continue
        result = json.loads(path.read_text())
        for key in ("command", "commit", "cpu", "cpu_flags", "date"):
            assert result.get(key), f"{path.name} has no {key}"
        assert re.fullmatch(r"[0-9a-f]{40}", result["commit"]), f"{path.name}: {result['commit']}"
