"""``batchyard run`` and ``batchyard check`` through click, against the fake gateway."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

from click.testing import CliRunner

from batchyard.cli.check import command as check_command
from batchyard.cli.text_runner import command as run_command
from tests.support.fake_gateway import FakeGateway, read_lines, write_jsonl


def _env(gw: FakeGateway) -> dict[str, str]:
    return {"BATCHYARD_BASE_URL": gw.base_url, "BATCHYARD_API_KEY": gw.api_key}


def test_run_answers_a_csv_and_reports(
    gateway: FakeGateway, tmp_path: Path, decisions_file: Path
) -> None:
    csv_path = tmp_path / "comments.csv"
    csv_path.write_text("cid,body\n" + "".join(f"{i},comment {i}\n" for i in range(5)))
    out = tmp_path / "answers.jsonl"
    args = [
        str(csv_path),
        "--decisions",
        str(decisions_file),
        "--model",
        "kettei-core",
        "--output",
        str(out),
        "--id-field",
        "cid",
        "--text-field",
        "body",
    ]
    result = CliRunner().invoke(run_command, args, env=_env(gateway))
    assert result.exit_code == 0, result.output
    assert "5 texts to send" in result.output
    assert "Credit available: $10" in result.output
    assert "Answered 5 this run" in result.output
    assert sorted(r["id"] for r in read_lines(out)) == [str(i) for i in range(5)]
    again = CliRunner().invoke(run_command, args, env=_env(gateway))
    assert again.exit_code == 0 and "5 already answered" in again.output


def test_run_stops_on_bad_input_before_sending(
    gateway: FakeGateway, tmp_path: Path, decisions_file: Path
) -> None:
    texts = write_jsonl(tmp_path / "t.jsonl", [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}])
    result = CliRunner().invoke(
        run_command,
        [
            str(texts),
            "--decisions",
            str(decisions_file),
            "--model",
            "kettei-core",
            "--output",
            str(tmp_path / "o.jsonl"),
        ],
        env=_env(gateway),
    )
    assert result.exit_code == 1
    assert "ids appear more than once: 'a'" in result.output
    assert gateway.requests == []


def test_run_refuses_without_credit_unless_yes(
    gateway: FakeGateway, tmp_path: Path, decisions_file: Path
) -> None:
    gateway.credit = Decimal("0.000001")
    texts = write_jsonl(tmp_path / "t.jsonl", [{"id": str(i), "text": "hello"} for i in range(3)])
    args = [
        str(texts),
        "--decisions",
        str(decisions_file),
        "--model",
        "kettei-core",
        "--output",
        str(tmp_path / "o.jsonl"),
    ]
    result = CliRunner().invoke(run_command, args, env=_env(gateway))
    assert result.exit_code == 1 and "pass --yes" in result.output
    assert gateway.decide_requests() == []
    forced = CliRunner().invoke(run_command, [*args, "--yes"], env=_env(gateway))
    assert forced.exit_code == 1 and "Stopped early: insufficient_credit" in forced.output


def test_check_prints_the_table_and_writes_the_report(
    gateway: FakeGateway, tmp_path: Path, decisions_file: Path
) -> None:
    labels = write_jsonl(
        tmp_path / "labels.jsonl",
        [
            {
                "id": "1",
                "text": "sentiment=negative spam=no",
                "labels": {"sentiment": "negative", "spam": "no"},
            },
            {
                "id": "2",
                "text": "sentiment=positive spam=yes",
                "labels": {"sentiment": "positive", "spam": "yes"},
            },
        ],
    )
    report = tmp_path / "report.json"
    result = CliRunner().invoke(
        check_command,
        [
            "--labels",
            str(labels),
            "--decisions",
            str(decisions_file),
            "--model",
            "kettei-core",
            "--model",
            "kettei-dumb",
            "--json",
            str(report),
        ],
        env=_env(gateway),
    )
    assert result.exit_code == 0, result.output
    assert "100.0% (4/4)" in result.output
    # Raw beside calibrated, per model and decision.
    assert "kettei-core · sentiment: raw beside calibrated" in result.output
    assert "kettei-dumb · spam: raw beside calibrated" in result.output
    assert "balanced accuracy" in result.output and "expected calibration error" in result.output
    body = json.loads(report.read_text())
    assert [m["model"] for m in body["models"]] == ["kettei-core", "kettei-dumb"]
    assert body["models"][1]["accuracy"] == {"sentiment": 0.5, "spam": 0.5}


def test_check_shows_what_calibration_bought(
    gateway: FakeGateway, tmp_path: Path, decisions_file: Path
) -> None:
    gateway.calibrating = {"kettei-core"}
    rows = [
        {"id": str(i), "text": f"sentiment={s} spam=no", "labels": {"sentiment": s, "spam": "no"}}
        for i, s in enumerate(["positive", "negative", "neutral", "negative"])
    ]
    labels = write_jsonl(tmp_path / "labels.jsonl", rows)
    report = tmp_path / "report.json"
    args = ["--labels", str(labels), "--decisions", str(decisions_file), "--model", "kettei-core"]
    result = CliRunner().invoke(check_command, [*args, "--json", str(report)], env=_env(gateway))
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    row = next(line for line in lines if "balanced accuracy" in line)
    # sentiment: raw picks the first outcome (positive) every time; calibrated is right.
    assert "33.3%" in row and "100.0%" in row
    assert any(
        "negative" in line and "positive:2" in line and "negative:2" in line for line in lines
    )
    quality = json.loads(report.read_text())["models"][0]["quality"]["sentiment"]
    assert quality["raw"]["accuracy"] == 0.25 and quality["calibrated"]["accuracy"] == 1.0
    assert quality["raw"]["confusion"]["negative"]["positive"] == 2
