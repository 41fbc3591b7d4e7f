"""``tailguard advise``'s command line: how much of the input it replays, refusing too little, progress, plain help."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from tailguard.server.advise.access_log import write_log
from tailguard.server.advise.cli import MAX_SECONDS, MIN_REQUESTS, ProgressLine, main
from tailguard.server.advise.replay.fleet import Arrival
from tests.advise.test_planner import SMALL_POOLS


def _sparse(n: int, every: float, start: float = 0.0) -> list[Arrival]:
    """``n`` requests ``every`` seconds apart from ``start``, a third long: traffic an idle fleet serves quickly."""
    return [
        Arrival(i, start + i * every, "long" if i % 3 == 0 else "short", True, 1500 if i % 3 == 0 else 100 + i, 256 if i % 3 == 0 else 64)
        for i in range(n)
    ]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(SMALL_POOLS)  # two engines: 7 layouts and 2 baselines a run
    return path


def _log(path: Path, arrivals: list[Arrival]) -> Path:
    write_log(path, arrivals, None, "interactive", "batch")
    return path


def _trace(path: Path, arrivals: list[Arrival]) -> Path:
    rows = [{"at": a.at, "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens, "class": a.kind} for a in arrivals]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_an_access_log_is_replayed_whole_by_default(tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A log longer than the old 120 s default: every line is used, and the first line says so."""
    log = _log(tmp_path / "tailguard.log", _sparse(60, 5.0))  # 295 s of arrivals
    assert main(["--access-log", str(log), "--config", str(config), "--keep-thresholds"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{log}: used 60 of 60 lines, 295 s of arrivals, none skipped\n")
    assert "60 requests over 295.0 s" in out and "Recommended" in out


def test_a_trace_is_replayed_whole_by_default(tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _trace(tmp_path / "trace.jsonl", _sparse(60, 5.0))
    assert main(["--trace", str(trace), "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{trace}: used 60 of 60 trace rows, 295 s of arrivals, none skipped\n")
    assert "60 requests over 295.0 s" in out


def test_seconds_bounds_the_replay_and_too_little_gets_no_recommendation(
    tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """17 of 326 lines gave a confident pick that a longer window overturned: under MIN_REQUESTS, advise refuses."""
    log = _log(tmp_path / "tailguard.log", _sparse(60, 5.0))
    assert main(["--access-log", str(log), "--config", str(config), "--keep-thresholds", "--seconds", "100"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no report, no snippet to paste
    assert f"{log}: used 20 of 60 lines, 95 of 295 s of arrivals" in captured.err
    assert f"20 requests to replay; a recommendation needs at least {MIN_REQUESTS}" in captured.err
    assert "--seconds" in captured.err  # the way to more: a larger window
    trace = _trace(tmp_path / "trace.jsonl", _sparse(MIN_REQUESTS - 1, 1.0))
    assert main(["--trace", str(trace), "--config", str(config)]) == 2
    assert f"{MIN_REQUESTS - 1} requests to replay; a recommendation needs at least {MIN_REQUESTS}" in capsys.readouterr().err


def test_a_log_longer_than_advise_replays_is_cut_and_says_so(tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    late = _sparse(1, 1.0, start=MAX_SECONDS + 100.0)
    log = _log(tmp_path / "tailguard.log", _sparse(60, 5.0) + [Arrival(60, late[0].at, "short", True, 120, 64)])
    assert main(["--access-log", str(log), "--config", str(config), "--keep-thresholds"]) == 0
    out = capsys.readouterr().out
    whole = f"{MAX_SECONDS + 100:,.0f}"
    assert out.startswith(f"{log}: used 60 of 61 lines, 295 of {whole} s of arrivals; 1 skipped: 1 after the replayed window")
    assert f"Cut: advise replays at most {MAX_SECONDS:,.0f} s" in out


def test_progress_goes_to_stderr_and_the_report_alone_to_stdout(tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Not a terminal (a pipe, a file, CI): one line as each stage of replays starts."""
    log = _log(tmp_path / "tailguard.log", _sparse(60, 5.0))
    assert main(["--access-log", str(log), "--config", str(config), "--json", str(tmp_path / "advice.json")]) == 0
    captured = capsys.readouterr()
    sets = [row["thresholds"] for row in json.loads((tmp_path / "advice.json").read_text())["thresholds"]["sets"]]
    # The file's set is the layout search; each further set replays its layouts and the baselines, "none" the shared pool alone.
    expected = ["tailguard advise: layouts under the file's thresholds: replaying 9 set-ups ..."]
    expected += [f"tailguard advise: thresholds {i} of {len(sets)} (" for i in range(2, len(sets) + 1)]
    lines = captured.err.splitlines()
    assert len(sets) >= 3 and len(lines) == len(expected)
    assert lines[0] == expected[0] and all(line.startswith(start) for line, start in zip(lines[1:], expected[1:]))
    assert lines[-1].endswith("(no interactive class): replaying 3 set-ups ...")
    assert captured.out.startswith(f"{log}: used 60 of 60 lines") and "replaying" not in captured.out


def test_on_a_terminal_progress_is_one_line_rewritten_after_each_set_up() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    line = ProgressLine(stream)
    for stage, total in (("layouts", 3), ("thresholds 2 of 2 (no interactive class)", 1)):
        show = line.stage(stage)
        for done in range(total + 1):
            show(done, total)
    text = stream.getvalue()
    shown = text.split("\r")[1:]
    assert [s.rstrip() for s in shown] == [
        *(f"tailguard advise: layouts: replayed {done} of 3 set-ups" for done in range(4)),
        "tailguard advise: thresholds 2 of 2 (no interactive class): replayed 0 of 1 set-ups",
        "tailguard advise: thresholds 2 of 2 (no interactive class): replayed 1 of 1 set-ups",
    ]
    assert text.count("\n") == 2 and shown[3].endswith("\n")  # a finished stage keeps its line; the next starts below it


def test_help_is_plain_text_and_states_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """--help is read in a terminal: no docstring markup (``double backticks``), markdown or unfilled %(...)s."""
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for marker in ("`", "**", "](", "%(", "\\", "# "):
        assert marker not in text, marker
    flat = " ".join(text.split())  # argparse wraps the options' help
    assert "default: the whole input" in flat and f"{MAX_SECONDS:,.0f} s" in flat
    assert f"fewer than {MIN_REQUESTS} requests to replay" in flat and "exits with status 2" in flat
    assert "progress on stderr" in flat
