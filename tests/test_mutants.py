"""The planted-bug list of tests/mutants.py cannot rot: every snippet still occurs exactly once in the
code it mutates, every replacement changes it, and every test a mutant names still exists.
(The mutants themselves are run by hand: `OMP_NUM_THREADS=1 python tests/mutants.py`.)"""
import re

import pytest

import mutants

ROOT = mutants.ROOT


@pytest.mark.parametrize("m", mutants.MUTANTS, ids=lambda m: m.name)
def test_every_planted_snippet_still_matches_the_code_exactly_once(m):
    assert not mutants.occurrences(m), (
        f"mutant {m.name!r}: a snippet no longer occurs exactly once in {m.file} "
        f"({mutants.occurrences(m)}); update the entry in tests/mutants.py to the new code")
    assert all(original != replacement for original, replacement in m.edits)


@pytest.mark.parametrize("m", mutants.MUTANTS, ids=lambda m: m.name)
def test_every_mutant_names_tests_that_exist(m):
    assert m.tests
    for node in m.tests:
        path, _, name = node.partition("::")
        source = (ROOT / path).read_text()
        assert not name or re.search(rf"^def {re.escape(name)}\(", source, re.M), f"{m.name!r}: no test {node}"


def test_mutant_names_are_unique():
    names = [m.name for m in mutants.MUTANTS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("statuses, expected", [
    ({"fast": 1}, ("caught", "fast")),              # the fast command's tests fail: the deep ones never run
    ({"fast": 0, "deep": 1}, ("caught", "deep")),
    ({"fast": 5, "deep": 1}, ("caught", "deep")),   # 5: none of its tests is in the fast set
    ({"fast": 0, "deep": 5}, ("SURVIVED", "")),
    ({"fast": 0, "deep": 0}, ("SURVIVED", "")),
    ({"fast": "timeout"}, ("timeout", "fast")),
])
def test_the_runner_says_which_command_caught_a_mutant(monkeypatch, statuses, expected):
    ran = []

    def run_tests(root, tests, timeout):
        command = {"not deep": "fast", "deep": "deep"}[tests[1]]
        ran.append(command)
        assert tests[0] == "-m" and tests[2:] == ("tests/test_x.py::test_y",)
        return statuses[command], 1.0

    monkeypatch.setattr(mutants, "run_tests", run_tests)
    verdict, command, seconds = mutants.catch(ROOT, ("tests/test_x.py::test_y",), timeout=9)
    assert (verdict, command) == expected and ran == list(statuses) and seconds == len(ran)
