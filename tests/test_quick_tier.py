"""The quick tier (``make check``): tests marked ``e2e`` are left out, and an unmarked
test that starts a process, in any of the ways the code here does, fails there and
still runs in the whole suite."""

from __future__ import annotations

import pytest

SUITE = """
import asyncio, os, subprocess, sys
import pytest

def test_plain():
    assert sum([1, 2]) == 3

def test_subprocess():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)

def test_asyncio_subprocess():
    async def main():
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
        await proc.wait()
    asyncio.run(main())

def test_unshare():
    os.unshare(os.CLONE_NEWUTS)

@pytest.mark.e2e
def test_marked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


def _outcomes(pytester: pytest.Pytester, *args: str) -> dict[str, str]:
    pytester.makepyfile(test_suite=SUITE)
    pytester.makeini(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\n"
        "markers =\n    e2e: starts processes\n"
    )
    reports = pytester.inline_run("-p", "tests.quicktier", *args)
    return {
        r.nodeid.rsplit("::", 1)[1]: r.outcome
        for r in reports.getreports("pytest_runtest_logreport")
        if r.when == "call" or r.outcome != "passed"
    }


def test_the_quick_tier_fails_an_unmarked_test_that_starts_a_process(pytester) -> None:
    seen = _outcomes(pytester, "--quick")
    assert seen == {
        "test_plain": "passed",
        "test_subprocess": "failed",
        "test_fork": "failed",
        "test_asyncio_subprocess": "failed",
        "test_unshare": "failed",
    }  # and test_marked is not run at all


@pytest.mark.e2e  # its tests start processes
def test_the_whole_suite_runs_every_test_unguarded(pytester) -> None:
    seen = _outcomes(pytester, "-k", "not unshare")  # unshare needs privileges
    assert seen == {
        "test_plain": "passed",
        "test_subprocess": "passed",
        "test_fork": "passed",
        "test_asyncio_subprocess": "passed",
        "test_marked": "passed",
    }


def test_the_quick_tier_does_not_import_a_module_marked_e2e_as_a_whole(pytester) -> None:
    """Each of its test processes would import the module only to deselect every test."""
    pytester.makepyfile(
        test_whole="import pytest\npytestmark = [pytest.mark.e2e]\nraise SystemExit('imported')\n",
        test_some="import pytest\n\n@pytest.mark.e2e\ndef test_a():\n    pass\n\n"
        "def test_b():\n    pass\n",
    )
    pytester.makeini(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\n"
        "markers =\n    e2e: starts processes\n"
    )
    quick = pytester.inline_run("-p", "tests.quicktier", "--quick")
    quick.assertoutcome(passed=1)  # test_b; test_whole.py never imported
    whole = pytester.inline_run("-p", "tests.quicktier")
    assert whole.ret != 0  # without --quick it is imported, and its import fails
