"""The modules holding long tests are collected first, the longest first, each with its
long tests leading; the other tests keep their places and a module stays together."""

from __future__ import annotations

SHORT = """
def test_a(): pass
def test_b(): pass
"""

ONE_LONG = """
import pytest
def test_c(): pass
@pytest.mark.long(20)
def test_d(): pass
"""

TWO_LONG = """
import pytest
@pytest.mark.long(10)
def test_e(): pass
def test_f(): pass
@pytest.mark.long(15)
def test_g(): pass
"""


def test_long_tests_and_their_modules_come_first(pytester) -> None:
    pytester.makepyfile(test_1short=SHORT, test_2one=ONE_LONG, test_3two=TWO_LONG)
    pytester.makeini(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\n"
        "markers =\n    long(seconds): takes long\n"
    )
    run = pytester.inline_run("--collect-only", "-p", "tests.longfirst")
    (finished,) = run.getcalls("pytest_collection_finish")
    assert [i.nodeid for i in finished.session.items] == [
        "test_3two.py::test_g",  # the module's 25 s before the other's 20 s
        "test_3two.py::test_e",
        "test_3two.py::test_f",
        "test_2one.py::test_d",
        "test_2one.py::test_c",
        "test_1short.py::test_a",
        "test_1short.py::test_b",
    ]
