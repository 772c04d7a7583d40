"""The skip policy of conftest.py: only a missing GPU may skip a test; under CI anything else fails
the run, and every run names the suites that did not run."""

from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

SUITE = """
import pytest

@pytest.mark.gpu
def test_on_the_gpu():
    import torch
    assert torch.cuda.is_available()

def test_needs_a_service():
    pytest.skip("etcd is not installed")

def test_plain():
    pass
"""


@pytest.fixture
def suite(pytester):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n")
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def test_a_skip_for_anything_but_a_gpu_fails_the_run_under_ci(suite, monkeypatch):
    monkeypatch.setenv("CI", "true")
    r = suite.runpytest_subprocess()
    assert r.ret == 1
    r.stdout.fnmatch_lines(
        [
            "*skipped for a reason other than a missing GPU*",
            "test_suite.py::test_needs_a_service: *etcd is not installed",
            "CI=true: a test may skip only for a missing GPU; failing the run",
        ]
    )


def test_outside_ci_the_stray_skip_is_named(suite, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    r = suite.runpytest_subprocess()
    assert r.ret == 0
    r.stdout.fnmatch_lines(["test_suite.py::test_needs_a_service: *etcd is not installed"])


def test_a_gpu_skip_alone_passes_under_ci(suite, monkeypatch):
    monkeypatch.setenv("CI", "true")
    r = suite.runpytest_subprocess("-k", "not needs_a_service")
    assert r.ret == 0
    assert "other than a missing GPU" not in r.stdout.str()
