"""A newcomer's check of the Markdown: README.md and docs/*.md render as written.

Checked without a renderer, by the rules GitHub's Markdown follows:
- code fences (```) are balanced, so no prose turns into code and no code into prose;
- a table's rows have as many cells as its header;
- every relative link points at a file that exists, and a `#anchor` at a heading of that file
  (GitHub's slug: lower case, punctuation dropped, spaces to '-', '-1', '-2' for repeats);
- the README's usage example runs as printed.
- the README's SmolLM2 perplexities are those of the results JSON it links.
- results/README.md names every results file, and every results JSON records its command, the
  commit of its code and its device.
"""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "results" / "README.md"]
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _prose_lines(text):
    """(line number, line) of the lines outside code fences."""
    inside = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        if not inside:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)      # a link keeps its words
    text = re.sub(r"[^\w\- ]", "", text)                       # punctuation goes (\w keeps é, ρ)
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    seen, out = {}, set()
    for _, line in _prose_lines(path.read_text()):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def test_slug_follows_github():
    assert slug("Projection for multi-GPU machines (`python -m echo_jax.bench project`)") == (
        "projection-for-multi-gpu-machines-python--m-echo_jaxbench-project")
    assert slug("Inference on the trained `small` model at P = 4") == (
        "inference-on-the-trained-small-model-at-p--4")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_fences_are_balanced(page):
    fences = [n for n, line in enumerate(page.read_text().splitlines(), 1)
              if line.lstrip().startswith("```")]
    assert len(fences) % 2 == 0, f"{page.name}: unbalanced code fences at lines {fences}"
    # An opening fence that follows prose directly is fine; a closing fence with a language tag
    # is an opening one in disguise.
    closing = fences[1::2]
    lines = page.read_text().splitlines()
    tagged = [n for n in closing if lines[n - 1].strip() != "```"]
    assert not tagged, f"{page.name}: a closing fence carries a language at lines {tagged}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_tables_have_whole_rows(page):
    bad, header = [], None
    for number, line in _prose_lines(page.read_text()):
        if not line.startswith("|"):
            header = None
            continue
        cells = len(re.findall(r"(?<!\\)\|", re.sub(r"`[^`]*`", "", line))) - 1
        if header is None:
            header = cells
        elif cells != header:
            bad.append((number, cells, header))
    assert not bad, f"{page.name}: rows (line, cells, header cells) that break the table: {bad}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = []
    for number, line in _prose_lines(page.read_text()):
        line = re.sub(r"`[^`]*`", "", line)
        for match in LINK.finditer(line):
            target = match.group(1) or match.group(2)
            if re.match(r"[a-z]+:", target):            # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            if not dest.exists():
                broken.append((number, target, "no such file"))
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append((number, target, "no such heading"))
    assert not broken, f"{page.name}: broken links (line, target, why): {broken}"


def test_readme_usage_example_runs():
    """The README's Usage block, run as printed (on 4 of the 8 fake CPU devices)."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Usage", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {}
    exec(compile(code, "README.md#usage", "exec"), scope)
    import numpy as np
    np.testing.assert_allclose(np.asarray(scope["y"]), 4.0, rtol=0, atol=0.05)
    ys = np.asarray(scope["ys"])
    assert ys.shape == (8, 1024)
    np.testing.assert_allclose(ys, np.repeat(4.0 * np.arange(1, 9)[:, None], 1024, 1), rtol=0.02)


def test_results_readme_names_every_file():
    """results/README.md maps every results file to the command that writes it."""
    index = (REPO / "results" / "README.md").read_text()
    files = [p.relative_to(REPO / "results").as_posix()
             for p in sorted((REPO / "results").rglob("*")) if p.is_file()]
    def named(f):   # by its path under results/, or under the section's folder, or its name
        parts = f.split("/")
        return any(f"`{'/'.join(parts[i:])}`" in index for i in range(len(parts)))
    missing = [f for f in files if f != "README.md" and not named(f)]
    assert not missing, f"results/README.md does not name: {missing}"


def test_every_results_json_records_its_command_commit_and_device():
    """Every JSON under results/ is an object with non-empty string "command", "commit" and
    "device" (echo_jax_tools.provenance writes them; older files carry them backfilled)."""
    import json
    bad = {}
    for path in sorted((REPO / "results").rglob("*.json")):
        record = json.loads(path.read_text())
        name = path.relative_to(REPO).as_posix()
        if not isinstance(record, dict):
            bad[name] = "not a JSON object"
            continue
        missing = [k for k in ("command", "commit", "device")
                   if not (isinstance(record.get(k), str) and record[k].strip())]
        if missing:
            bad[name] = missing
    assert not bad, f"results JSONs without a non-empty command / commit / device: {bad}"


def test_readme_smollm2_perplexities_match_their_results_file():
    """The README's SmolLM2 headline row quotes the JSON it links, rounded as printed."""
    import json
    row = next(line for _, line in _prose_lines((REPO / "README.md").read_text())
               if line.startswith("| SmolLM2-135M, P = 3, 20,480 tokens"))
    source = re.search(r"\]\((results/[^)]+\.json)\)", row).group(1)
    rows = {r["config"]: r for r in json.loads((REPO / source).read_text())["rows"]}
    quoted = {   # config: (perplexity, relative change in %) as the README prints them
        "16bit": re.search(r"perplexity ([\d.]+) at 16 bits", row).groups() + (None,),
        "8bit-comp": re.search(r"8-bit comp ([\d.]+) \(\+([\d.]+) %\)", row).groups(),
        "4bit-comp": re.search(r"4-bit comp ([\d.]+) \(\+([\d.]+) %\)", row).groups(),
        "4bit-none": re.search(r"uncompensated ([\d.]+) \(\+([\d.]+) %\)", row).groups(),
    }
    def printed(value, as_quoted):   # value rounded to as_quoted's decimals
        decimals = len(as_quoted.partition(".")[2])
        return f"{value:.{decimals}f}"
    for config, (ppl, pct) in quoted.items():
        assert printed(rows[config]["perplexity"], ppl) == ppl, (config, source)
        if pct is not None:
            assert printed(rows[config]["rel_delta_ppl_vs_16bit_pct"], pct) == pct, (config, source)
