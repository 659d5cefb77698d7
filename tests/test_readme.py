"""The README and docs/ against the code: every variable documented, the README short, no dead links.

Fast and offline: reads files only. A new ``REWIND_*`` variable read anywhere under infra/, tasks/,
flows/ or examples/ fails this until it has a row in the README's configuration table (test-only
``REWIND_TEST_*`` variables are listed in docs/testing.md instead).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CODE_DIRS = ("infra", "tasks", "flows", "examples")
MAX_README_LINES = 300

VARIABLE = re.compile(r"REWIND_[A-Z0-9_]+")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)


def code_variables(root: Path = ROOT) -> set[str]:
    """Every ``REWIND_*`` name in the shipped Python code, test-only ones left out."""
    found: set[str] = set()
    for folder in CODE_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            found.update(VARIABLE.findall(path.read_text(encoding="utf-8")))
    return {name for name in found if not name.startswith("REWIND_TEST_")}


def section(markdown: str, title: str) -> str:
    """The text under the level-2 heading ``title``, up to the next level-2 heading ('' if none)."""
    match = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", markdown, re.MULTILINE | re.DOTALL)
    return match.group(1) if match else ""


def undocumented(names: Iterable[str], text: str) -> list[str]:
    """The names that do not appear in ``text`` as a whole name (``REWIND_X`` is not in ``REWIND_X_Y``)."""
    return sorted(n for n in names if not re.search(rf"(?<![A-Z0-9_]){re.escape(n)}(?![A-Z0-9_])", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, title in HEADING.findall(FENCE.sub("", markdown)):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Relative links in ``page`` whose target is missing, outside the repository, or lacks the anchor."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    bad = []
    for target in LINK.findall(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # https:, mailto:, ...: not relative
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page.resolve()
        if not dest.is_relative_to(root.resolve()):
            bad.append(f"{target} (outside the repository)")
        elif not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            bad.append(f"{target} (no heading #{anchor} in {dest.name})")
    return bad


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


# -- the checks ----------------------------------------------------------------------------


def test_every_variable_the_code_reads_is_in_the_configuration_table() -> None:
    config = section(README.read_text(encoding="utf-8"), "Configuration")
    assert config, "README.md has no '## Configuration' section"
    names = code_variables()
    assert "REWIND_CATALOG_URL" in names  # the scan itself works
    missing = undocumented(names, config)
    assert not missing, f"REWIND_* variables read by the code but not in README's configuration: {missing}"


def test_every_deployment_is_in_the_flows_table() -> None:
    flows = section(README.read_text(encoding="utf-8"), "Flows")
    deployments = re.findall(r"^  - name: (\S+)", (ROOT / "prefect.yaml").read_text(encoding="utf-8"), re.M)
    assert "recover-training" in deployments  # the scan itself works
    missing = [d for d in deployments if f"| `{d}` |" not in flows]
    assert not missing, f"deployments in prefect.yaml missing from README's flows table: {missing}"


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (at most {MAX_README_LINES}: move detail to docs/)"
    )


def test_relative_links_point_at_files_that_exist() -> None:
    assert len(pages()) > 1, "no docs/*.md pages found"
    bad = {p.relative_to(ROOT).as_posix(): broken_links(p) for p in pages()}
    bad = {page: links for page, links in bad.items() if links}
    assert not bad, f"broken relative links: {bad}"


# -- the checks can fail ---------------------------------------------------------------------


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    (tmp_path / "infra").mkdir()
    (tmp_path / "infra" / "x.py").write_text(
        'A = os.environ.get("REWIND_NEW_KNOB")\nB = "REWIND_TEST_ONLY"\nC = "REWIND_NEW_KNOB_FILE"\n'
    )
    names = code_variables(tmp_path)
    assert names == {"REWIND_NEW_KNOB", "REWIND_NEW_KNOB_FILE"}
    doc = "# T\n\n## Configuration\n\n| `REWIND_NEW_KNOB_FILE` | x |\n\n## Later\n\nREWIND_NEW_KNOB\n"
    assert undocumented(names, section(doc, "Configuration")) == ["REWIND_NEW_KNOB"]

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "real.md").write_text("# Real page\n\n## A `code` heading, here\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/real.md) [ok](docs/real.md#a-code-heading-here) [web](https://example.org/x)\n"
        "[gone](docs/missing.md) [anchor](docs/real.md#nowhere) [out](../elsewhere.md)\n"
        "```\n[in a code block](not/checked.md)\n```\n"
    )
    assert broken_links(page, tmp_path) == [
        "docs/missing.md (no such file)",
        "docs/real.md#nowhere (no heading #nowhere in real.md)",
        "../elsewhere.md (outside the repository)",
    ]
