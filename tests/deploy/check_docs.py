#!/usr/bin/python3
"""The README stays a README, and the links of the README and docs/ lead somewhere.

  - README.md has at most MAX_README_LINES lines, and its "## Two commands" section shows
    `scripts/demo.sh` and `scripts/test.sh` in a bash block;
  - every relative link and image of README.md and docs/**/*.md (outside code) names a file or
    directory that exists in the tree, and every #anchor (in the same page or another markdown
    page) names a heading of that page, as GitHub makes anchors from headings.

usage: check_docs.py [--source-dir DIR]
"""

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import deploy_common as dc  # noqa: E402

MAX_README_LINES = 250


def strip_code(text):
    """The text without fenced code blocks and inline code spans (links in code are not links)."""
    out, inside = [], False
    for line in text.splitlines():
        if re.match(r"^\s*(```|~~~)", line):
            inside = not inside
            out.append("")
            continue
        out.append("" if inside else re.sub(r"(`+)(?:(?!\1).)+?\1", "", line))
    return "\n".join(out)


def slug(heading):
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation other than - and _
    dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path, cache={}):
    """The anchors of a markdown file's headings (duplicates numbered -1, -2, ... as GitHub does)."""
    if path not in cache:
        found, seen = set(), {}
        inside = False
        for line in path.read_text().splitlines():
            if re.match(r"^\s*(```|~~~)", line):
                inside = not inside
                continue
            m = None if inside else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if not m:
                continue
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        cache[path] = found
    return cache[path]


def check_links(f, source, page):
    text = strip_code(page.read_text())
    where = page.relative_to(source)
    count = 0
    for target in re.findall(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        count += 1
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page.resolve()
        if not f.check(dest.exists(), f"{where}: link ({target}): {file_part} does not exist"):
            continue
        try:
            dest.relative_to(source.resolve())
        except ValueError:
            f.add(f"{where}: link ({target}) leaves the repository")
            continue
        if anchor:
            if f.check(dest.is_file() and dest.suffix == ".md", f"{where}: link ({target}): an anchor into a "
                       "file that is not markdown"):
                f.check(anchor in anchors(dest), f"{where}: link ({target}): {dest.name} has no heading with the "
                        f"anchor #{anchor} (it has {sorted(anchors(dest))})")
    return count


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--source-dir", default=str(dc.SOURCE_DIR))
    source = Path(parser.parse_args().source_dir)
    f = dc.Failures("check_docs")
    readme = source / "README.md"
    text = readme.read_text()
    lines = len(text.splitlines())
    f.check(lines <= MAX_README_LINES, f"README.md has {lines} lines, more than {MAX_README_LINES}: move the detail "
            "to a docs/ page and link it")
    m = re.search(r"^## Two commands\s*$(.*?)(?=^## |\Z)", text, re.S | re.M)
    if f.check(m is not None, 'README.md has no "## Two commands" section'):
        block = re.search(r"```bash\n(.*?)```", m.group(1), re.S)
        shown = [l.split()[0] for l in (block.group(1).splitlines() if block else []) if l.strip() and not
                 l.lstrip().startswith("#")]
        f.check(shown == ["scripts/demo.sh", "scripts/test.sh"],
                f'README.md "## Two commands": a bash block of scripts/demo.sh and scripts/test.sh, found {shown}')
    pages = [readme] + sorted((source / "docs").rglob("*.md"))
    links = sum(check_links(f, source, page) for page in pages)
    f.finish(f"README.md {lines} lines (at most {MAX_README_LINES}); {links} relative links of {len(pages)} pages "
             "resolve, anchors included")


if __name__ == "__main__":
    main()
