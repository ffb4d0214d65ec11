"""Every command a page gives for a result it reads reproduces that result.

A chapter or lab that reads ``results/<name>.<machine>.json`` (``results.load_result("<name>")``) must show the
command that makes that run again at this code: the file's recorded ``command`` as a reader types it
(``results.reader_commands``: the GPU machine's scratch path read as ``python -m labsupport``, no ``--timeout``;
a co-located capstone run made before the switches existed gets the ``--config`` that sets what its defaults
were then, which the Reference runs page says beside the recorded command). The page may show it in inline code,
a code block or a printed message; whitespace and backquotes do not count.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from labsupport.course import results

ROOT = Path(__file__).resolve().parent.parent
PAGES = [p for p in sorted((ROOT / "book").glob("*.md")) + sorted((ROOT / "labs").glob("*.md"))
         if p.name not in ("reference_runs.md", "instructors.md")]
READS = re.compile(r"(?:load_result|list_results)\(\s*[\"']([\w.]+)[\"']")


def _flat(text: str) -> str:
    return " ".join(text.replace("\\\n", " ").replace("`", " ").split())


def missing_commands(page: Path, results_dir: Path = ROOT / "results") -> list[str]:
    """The reader commands of the results ``page`` reads that the page does not show."""
    text = page.read_text()
    shown = _flat(text)
    out = []
    for name in sorted(set(READS.findall(text))):
        for path in sorted(results_dir.glob(f"{name}.*.json")):
            rec = json.loads(path.read_text())
            if rec.get("name") != name:
                continue
            out += [f"{page.name} reads {path.name}: `{cmd}`" for cmd in results.reader_commands(rec)
                    if cmd not in shown]
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_shows_the_command_of_each_result_it_reads(page: Path) -> None:
    bad = missing_commands(page)
    assert not bad, ("a page that reads a result must show the command that reproduces it (add it where the page "
                     "says what makes the run):\n" + "\n".join(bad))


def test_reader_commands() -> None:
    rec = {"name": "bench_peer", "date": "2026-11-28T06:44:45+00:00",
           "command": "python3 /tmp/x/tree/labsupport/__main__.py bench peer --timeout 900 --capstone-configs fastest"}
    assert results.reader_commands(rec) == ["python -m labsupport bench peer --capstone-configs fastest"]
    old = {"name": "capstone_colocated_vllm_0.5b", "date": "2026-11-25T11:14:21+00:00",
           "command": "python3 /w/.snap/labsupport/__main__.py rl --arch colocated --engine vllm --size 0.5b"}
    assert results.reader_commands(old) == [
        "python -m labsupport rl --arch colocated --engine vllm --size 0.5b --config safe+offload+no-graphs"]
    assert results.reader_commands({**old, "date": "2026-12-01T00:00:00+00:00"})[0].endswith("--size 0.5b")
    two = {"name": "bench_lora", "command": "python -m labsupport bench lora --shapes 1.5b (at abc); "
                                            "python -m labsupport bench lora --shapes 7b (at def, after x)"}
    assert results.reader_commands(two) == ["python -m labsupport bench lora --shapes 1.5b",
                                            "python -m labsupport bench lora --shapes 7b"]


def test_the_check_catches_a_missing_command(tmp_path: Path) -> None:
    """Positive and negative controls on a made-up page and result."""
    (tmp_path / "bench_x.1xH100.json").write_text(json.dumps(
        {"name": "bench_x", "command": "python3 /s/labsupport/__main__.py bench x --big", "date": "2026-12-01"}))
    page = tmp_path / "page.md"
    page.write_text('r = results.load_result("bench_x")\n\n`python -m labsupport bench x` measures it.\n')
    assert missing_commands(page, tmp_path)
    page.write_text('r = results.load_result("bench_x")\n\n`python -m labsupport bench x --big` measures it.\n')
    assert not missing_commands(page, tmp_path)
