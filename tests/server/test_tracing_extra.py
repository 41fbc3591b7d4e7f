"""``[tracing]`` on without the ``tracing`` extra: the error names the install, at start and on reload.

The OTLP exporter is an extra (``pip install 'tailguard[tracing]'``), not a
dependency of every install; its absence is simulated by making its import
fail (a ``None`` in ``sys.modules``), not by uninstalling it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tailguard.router.config import ConfigError, TracingConfig
from tailguard.router.observe.tracing import INSTALL_TRACING, Tracing
from tailguard.server.cli import main
from tailguard.server.trace_switch import TracingSwitch
from tests.helpers.process import config_on_free_ports

EXPORTER = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
ON = TracingConfig(enabled=True, endpoint="http://127.0.0.1:9/v1/traces")


@pytest.fixture
def no_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exporter's module cannot be imported, as where the extra is not installed."""
    monkeypatch.setitem(sys.modules, EXPORTER, None)


def test_the_extra_is_named_where_the_exporter_is_missing(no_exporter: None) -> None:
    assert INSTALL_TRACING == "pip install 'tailguard[tracing]'"
    with pytest.raises(ConfigError) as missing:
        Tracing(ON)
    (problem,) = missing.value.problems
    assert problem.startswith("tracing.enabled: ") and problem.endswith(INSTALL_TRACING)
    # A reload that turns tracing on is refused whole: the switch keeps tracing off.
    switch = TracingSwitch(TracingConfig(), grace=lambda: 1.0)
    with pytest.raises(ConfigError, match=r"tailguard\[tracing\]"):
        switch.apply(ON)
    assert switch() is None and switch.config == TracingConfig()


def test_serve_with_tracing_on_and_no_exporter_exits_2_in_one_line_naming_the_extra(
    no_exporter: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = config_on_free_ports(tmp_path)
    path.write_text(path.read_text() + '\n[tracing]\nenabled = true\nendpoint = "http://127.0.0.1:9/v1/traces"\n')
    assert main(["serve", "--simulate", "--no-grpc", "--config", str(path), "--log-level", "WARNING"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tailguard: tracing.enabled: the OTLP exporter is not installed") and err.endswith(f"{INSTALL_TRACING}\n"), err
    assert "Traceback" not in err
