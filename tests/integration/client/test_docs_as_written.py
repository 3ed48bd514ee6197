"""The README and the docs pages, tried as written: their commands run and say what they show.

``README.md``: its first use of each door runs, block by block, in one bash against a
live server (tier 0 sped up, a scripted engine: the commands are checked, not the model).

``docs/how-to/score-texts.md``: every file its commands name exists (from the
repository's root), and its estimate is what the command prints, the one-off
calibration prompts shown apart from each text's tokens. ``docs/reference/decide.md``:
its curl walk-through runs, block by block, in bash against a live server on
default settings (tier 0, the embedded model, the real CLI for keys and
credit), and each step answers as the page says.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchyard.cli.text_runner import command as run_command
from batchyard.core.tiers import DEFAULT_TIERS
from batchyard.engines.scripted import ScriptedEngine
from tests.support.threaded_server import Gateway, ServerThread

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
SCORE_TEXTS = ROOT / "docs" / "how-to" / "score-texts.md"
DECIDE = ROOT / "docs" / "reference" / "decide.md"


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _commands(block: str) -> list[list[str]]:
    """The shell commands of a block, continuation lines joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    return [
        shlex.split(line, comments=True)
        for line in joined.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_every_file_the_score_texts_page_reads_exists() -> None:
    named: list[str] = []
    for block in _blocks(SCORE_TEXTS.read_text(), "sh"):
        for argv in _commands(block):
            if argv[:1] != ["batchyard"]:
                continue
            if argv[1] == "run":
                named.append(argv[2])
            named += [argv[i + 1] for i, a in enumerate(argv) if a in ("--decisions", "--labels")]
    for match in re.finditer(
        r'(?:load_decisions|read_texts|read_labels)\("([^"]+)"', SCORE_TEXTS.read_text()
    ):
        named.append(match.group(1))
    assert named, "the page names no files"
    missing = sorted({n for n in named if not (ROOT / n).is_file()})
    assert not missing, f"docs/how-to/score-texts.md names files that do not exist: {missing}"


@pytest.fixture
def gateway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Gateway]:
    monkeypatch.setenv("BATCHYARD_HOME", str(tmp_path))
    monkeypatch.delenv("BATCHYARD_CONFIG", raising=False)
    server = ServerThread(tmp_path)
    try:
        yield server.start()
    finally:
        server.stop()
    assert server.problems == [], server.problems


ESTIMATE = re.compile(r"^Estimate from .*$", re.M)


@pytest.mark.model
def test_the_estimate_on_the_score_texts_page_is_what_the_command_prints(
    gateway: Gateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = SCORE_TEXTS.read_text()
    argv = next(
        argv
        for block in _blocks(page, "sh")
        for argv in _commands(block)
        if argv[:2] == ["batchyard", "run"] and "--estimate" in argv
    )
    shown = page[page.index("--estimate\n```") :]
    shown_line = ESTIMATE.search(shown)
    assert shown_line is not None
    key = gateway.org("acme", tier=1, credit="50")
    out = str(tmp_path / "answers.jsonl")
    args = [out if a == "answers.jsonl" else a for a in argv[2:]]
    monkeypatch.chdir(ROOT)  # the page's paths are from the repository's root
    result = CliRunner().invoke(
        run_command,
        [*args, "--base-url", gateway.base, "--api-key", key],
        env={"COLUMNS": "400"},
    )
    assert result.exit_code == 0, result.output
    printed = ESTIMATE.search(result.output)
    assert printed is not None, result.output
    assert printed.group(0) == shown_line.group(0), (
        f"the page shows\n  {shown_line.group(0)}\nthe command prints\n{result.output}"
    )
    assert "once for calibration" in printed.group(0)
    assert not (tmp_path / "answers.jsonl").exists(), "--estimate writes nothing"


@pytest.mark.model
@pytest.mark.timeout(600)
def test_the_decide_curl_walk_through_runs_as_written(gateway: Gateway, tmp_path: Path) -> None:
    page = DECIDE.read_text()
    section = page[page.index("## Try it with curl") :]
    blocks = _blocks(section, "sh")
    setup = "\n".join(
        line
        for line in blocks[0].splitlines()
        if not line.startswith(("batchyard serve", "sleep "))
    )
    assert "URL=http://127.0.0.1:8000" in setup
    setup = setup.replace("URL=http://127.0.0.1:8000", f"URL={gateway.base}")
    env = {
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "BATCHYARD_HOME": str(tmp_path),
        "BATCHYARD_DATABASE_URL": f"sqlite:///{tmp_path / 'batchyard.db'}",
    }
    outputs = []
    script = setup
    for block in blocks[1:]:
        # One bash for the whole walk-through (the steps share $KEY, $H, $MAX), with a
        # marker between steps so that each step's output can be told apart.
        script += f"\necho; echo '--- step {len(outputs) + 1}'\n{block}"
        outputs.append(block)
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    steps = re.split(r"^--- step \d+\n", done.stdout, flags=re.M)[1:]
    assert len(steps) == 6, done.stdout
    estimate, _credit, decided, replayed, conflict, burst = steps
    assert '"max_cost"' in estimate and '"input_tokens"' in estimate
    assert '"answers"' in decided and '"charge"' in decided
    assert re.search(r"^idempotent-replayed: true", replayed, flags=re.I | re.M), replayed
    assert '"idempotency_conflict"' in conflict
    step6 = section[section.index("\n6. ") :]
    shown = _blocks(re.sub(r"^   ", "", step6, flags=re.M), "text")
    assert shown, "step 6 shows no output"
    expected = sorted(shown[0].split())
    codes = sorted(burst.split())
    assert codes == expected, f"step 6 answered {codes}, the page says {expected}\n{done.stderr}"


#: Tier 0 sixty times faster: the README's commands in seconds, under the same rules.
FAST_TIER0 = dataclasses.replace(
    DEFAULT_TIERS[0],
    requests_per_minute=DEFAULT_TIERS[0].requests_per_minute * 60,
    tokens_per_minute=DEFAULT_TIERS[0].tokens_per_minute * 60,
    estimate_tokens_per_minute=DEFAULT_TIERS[0].estimate_tokens_per_minute * 60,
)


@pytest.fixture
def scripted_gateway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Gateway]:
    monkeypatch.setenv("BATCHYARD_HOME", str(tmp_path))
    monkeypatch.delenv("BATCHYARD_CONFIG", raising=False)
    server = ServerThread(
        tmp_path,
        overrides={"tiers": (FAST_TIER0, *DEFAULT_TIERS[1:])},
        engines={"embedded": ScriptedEngine("Hello there.")},
    )
    try:
        yield server.start()
    finally:
        server.stop()
    assert server.problems == [], server.problems


@pytest.mark.timeout(600)
def test_the_readme_first_use_runs_as_written(scripted_gateway: Gateway, tmp_path: Path) -> None:
    page = README.read_text()
    section = page[page.index("## First use") : page.index("## Where to go next")]
    bin_dir = Path(sys.executable).parent
    work = tmp_path / "clone"
    (work / "examples").mkdir(parents=True)
    for f in (ROOT / "examples" / "data").iterdir():
        (work / "examples" / "data").mkdir(exist_ok=True)
        (work / "examples" / "data" / f.name).write_bytes(f.read_bytes())
    (work / ".venv").symlink_to(bin_dir.parent)
    script = ""
    steps = 0
    for block in re.findall(r"```(sh|python)\n(.*?)```", section, flags=re.S):
        lang, body = block
        if lang == "python":
            body = f"python - <<'PY'\n{body}PY\n"
        body = "\n".join(
            line for line in body.splitlines() if not line.startswith(".venv/bin/batchyard serve")
        )
        body = body.replace("localhost:8000", scripted_gateway.base.removeprefix("http://"))
        steps += 1
        script += f"\necho; echo '--- step {steps}'\n{body}\n"
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "BATCHYARD_HOME": str(tmp_path),
        "BATCHYARD_DATABASE_URL": f"sqlite:///{tmp_path / 'batchyard.db'}",
        "BATCHYARD_BASE_URL": scripted_gateway.base,
        "COLUMNS": "400",
    }
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = re.split(r"^--- step \d+\n", done.stdout, flags=re.M)[1:]
    assert len(out) == steps == 6, done.stdout
    _setup, decided, scored, run, batches, costs = out
    assert '"answers"' in decided and '"probabilities"' in decided, decided
    assert "Answered 40 this run" in scored, scored
    assert re.fullmatch(r"\s*0\.\d+\s*", run), run  # the run's quote, before it is confirmed
    assert '"min_discount"' in batches and "completed" in batches, batches
    assert '"charge"' in costs, costs
    assert "ledger sound" in done.stderr, done.stderr
