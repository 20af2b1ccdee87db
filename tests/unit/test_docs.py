"""The docs stay true to the code: the knob table is generated from csrc/common/env.h, the
README stays short, and every relative link in the README and docs/ resolves."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

from resilient_comm.config import knobs

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gen_knobs  # noqa: E402


def test_the_knob_page_is_generated_from_the_one_table_the_extension_reads() -> None:
    parsed = gen_knobs.parse_knobs(gen_knobs.ENV_H.read_text())
    built = [(k.name, k.default, k.doc) for k in knobs()]
    assert parsed == built, "scripts/gen_knobs.py reads env.h differently from the built extension"
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_knobs.py"), "--check"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert all(f"`{name}`" in page for name, _, _ in built)


def test_a_stale_knob_page_is_caught_and_named(tmp_path: pathlib.Path) -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    knobs_now = gen_knobs.parse_knobs(gen_knobs.ENV_H.read_text())
    stale = gen_knobs.render_page(page, knobs_now[1:])
    assert stale != page and gen_knobs.render_page(stale, knobs_now) == page


def test_the_readme_reads_in_five_minutes() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail to docs/"


_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    pages = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in _LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_docs_index_lists_every_page() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f"]({p.name})" not in index]
    assert not missing, f"docs/README.md does not list {missing}"
