"""The publishing workflow (.github/workflows/book.yml) builds what people build locally and deploys it to Pages.

It is read as YAML: its build job runs `make book` on a CPU runner, caches jupyter-book's execution cache, and
uploads the folder `make book` writes as the Pages artifact; its deploy job deploys that artifact, from `main`
only. Two workflow linters from PyPI check the file offline: check-jsonschema against GitHub's workflow schema,
and zizmor's audits (its policy, .github/zizmor.yml, lets GitHub's own actions be pinned by tag).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "book.yml"


@pytest.fixture(scope="module")
def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def _uses(job: dict, action: str) -> list[dict]:
    return [s for s in job["steps"] if s.get("uses", "").split("@")[0] == action]


def test_build_job_runs_make_book_and_uploads_its_site(workflow: dict) -> None:
    build = workflow["jobs"]["build"]
    assert "gpu" not in str(build["runs-on"]).lower(), "the book builds on CPU runners"
    runs = [s["run"].strip() for s in build["steps"] if "run" in s]
    assert "make book" in runs, "the workflow must run the make target people run locally"
    assert "_build/html" in (ROOT / "Makefile").read_text(), "make book no longer says where it writes the site"
    (cache,) = _uses(build, "actions/cache")
    assert cache["with"]["path"] == "_build/.jupyter_cache", "cache jupyter-book's executed notebooks"
    (upload,) = _uses(build, "actions/upload-pages-artifact")
    assert upload["with"]["path"] == "_build/html"


def test_deploy_job_deploys_the_artifact_from_main_only(workflow: dict) -> None:
    triggers = workflow[True] if True in workflow else workflow["on"]  # YAML 1.1 reads a bare `on` as True
    assert triggers["push"]["branches"] == ["main"]
    deploy = workflow["jobs"]["deploy"]
    assert deploy["needs"] == "build"
    assert "refs/heads/main" in deploy["if"] and "pull_request" in deploy["if"]
    assert deploy["permissions"] == {"pages": "write", "id-token": "write"}
    assert deploy["environment"]["name"] == "github-pages"
    assert _uses(deploy, "actions/deploy-pages")
    assert workflow["permissions"] == {"contents": "read"}, "the build job needs no write access"


@pytest.mark.parametrize("linter", [
    ["check-jsonschema", "--builtin-schema", "vendor.github-workflows"],
    ["zizmor", "--offline", "--config", str(ROOT / ".github" / "zizmor.yml")],
], ids=["schema", "zizmor"])
def test_workflow_linters_find_nothing(linter: list[str]) -> None:
    exe = Path(sys.executable).parent / linter[0]  # installed in the course's environment (requirements.txt)
    assert exe.exists(), f"{linter[0]} is missing: run `make setup` (it is in requirements.txt)"
    result = subprocess.run([str(exe), *linter[1:], str(WORKFLOW)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
