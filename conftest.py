"""Skips: only a test marked `gpu` may skip, and only where no CUDA device is present (CI has none).

Anything else a test needs is installed by `make install`; a suite that skips for another reason
is reported at the end of the run, and under CI (`CI=true`) it fails the run.
"""

import os

import pytest

GPU_SKIP = "needs a CUDA GPU"

# The skip policy below is itself tested (tests/test_skip_policy.py) through pytester.
pytest_plugins = ("pytester",)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _stray_skips(terminalreporter) -> list:
    return [r for r in terminalreporter.stats.get("skipped", []) if "gpu" not in r.keywords]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    stray = _stray_skips(terminalreporter)
    if not stray:
        return
    terminalreporter.section("skipped for a reason other than a missing GPU", red=True)
    for r in stray:
        reason = r.longrepr[2] if isinstance(r.longrepr, tuple) else str(r.longrepr)
        terminalreporter.line(f"{r.nodeid}: {reason}")
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        terminalreporter.line("CI=true: a test may skip only for a missing GPU; failing the run", red=True)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if (
        reporter is not None
        and os.environ.get("CI", "").lower() in ("1", "true", "yes")
        and _stray_skips(reporter)
        and session.exitstatus == 0
    ):
        session.exitstatus = 1
