"""bench.py check, the first GPU run, proved by its CPU twin: the same plan at tiny sizes.

The GPU run gets one command with a fixed timeout and returns only the files it wrote, so what matters is
what is on disk at any moment: every finished row, and a reason for every other one. Here README's GPU
command runs on the CPU to the end; then it is killed part-way (SIGTERM, SIGKILL); then a part is made to
run out of its time, with the data missing, in a plan whose parts are stand-in processes (seconds).
"""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import bench
from lib import budget

ROOT = Path(__file__).resolve().parent.parent
FINISHED = {"ok", "skipped"}


def readme_gpu_command() -> list[str]:
    """The flags of README's GPU check (the `bench.py check` line of its "On a GPU" section)."""
    section = (ROOT / "README.md").read_text().split("## On a GPU", 1)[1].split("\n## ", 1)[0]
    line = next(line for line in section.splitlines() if line.startswith("python bench.py check"))
    return line.split("python bench.py check", 1)[1].split("#")[0].split()


def check_process(out: Path, *flags: str, data_dir: str = "") -> subprocess.Popen:
    argv = [sys.executable, str(ROOT / "bench.py"), "check", "--device", "cpu", "--out", str(out), *flags]
    argv += ["--data-dir", data_dir] if data_dir else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def alive(pid: int) -> bool:
    """A process that runs (a zombie, dead but not yet reaped by whoever adopted it, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def report(out: Path) -> dict:
    return json.loads((out / "check.json").read_text())


def test_readme_s_gpu_command_runs_every_part_on_the_cpu(tmp_path, fashion_mnist_dir):
    """README's command on the CPU, with this test's --out and data folder (--budget as README's: the parts
    take seconds here). Latency rows first; every row a result; only the three report files in --out."""
    flags = readme_gpu_command()
    assert flags == ["--budget", "420"], flags
    process = check_process(tmp_path, *flags, data_dir=str(fashion_mnist_dir))
    stdout, _ = process.communicate(timeout=900)
    doc = report(tmp_path)
    assert process.returncode == 0 and doc["ok"] and doc["complete"], stdout[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(bench.CHECK_FILES)
    rows = {(r["part"], r["row"]): r for r in doc["rows"]}
    assert [r["part"] for r in doc["rows"][:8]] == ["latency, batch 1"] * 4 + ["latency, batch 4"] * 4
    for (part, row), r in rows.items():
        assert r["status"] in FINISHED, r
        if part.startswith("latency") or part.startswith("training step"):
            assert r["median_ms"] > 0 and r["ratio"] > 0 and r["precision"], r
    assert rows[("training step, elastic depth", "reViT elastic 0.3")]["precision"].endswith("step loop eager")
    tests = [r for r in doc["rows"] if r["part"] == "correctness"]
    assert len(tests) == 7 and all(r["status"] == "ok" and "[cpu" in r["row"] for r in tests)
    run = rows[("train.py run", "train.py run")]
    assert run["steps"] == 4 and 0 <= run["test_acc"] <= 1 and run["images_per_s"] > 0
    assert rows[("GPU tests that need the data", "GPU tests that need the data")]["status"] == "skipped"
    printed = stdout.strip().splitlines()
    assert json.loads(printed[-1]) == doc  # the JSON document is the last line, as for every subcommand
    assert any(line.startswith("latency, batch 1 | reViT cached | ok | ") for line in printed)  # as it finished
    markdown = (tmp_path / "check.md").read_text()
    assert markdown.index("## latency, batch 1") < markdown.index("## training step") < markdown.index("## correctness")
    assert "| reViT dynamic | 1 | ok |" in markdown and "Report complete" in markdown


def test_a_check_killed_part_way_leaves_every_finished_row_on_disk(tmp_path):
    """SIGKILL (nothing to catch) once the first latency rows are written: they stay, in both files, the rows
    then running say so, and the part then running dies with the check (PR_SET_PDEATHSIG)."""
    process = check_process(tmp_path, "--budget", "600")
    deadline, finished = time.monotonic() + 300, []
    while not finished and time.monotonic() < deadline:  # both files hold the rows (json first, then markdown)
        time.sleep(0.2)
        assert process.poll() is None, process.stdout.read()
        if (tmp_path / "check.md").exists() and "| reViT folded | 1 | ok |" in (tmp_path / "check.md").read_text():
            finished = [r for r in report(tmp_path)["rows"] if r["status"] == "ok"]
    process.kill()
    process.communicate(timeout=60)
    doc = report(tmp_path)  # a whole JSON document: never a torn file
    kept = {(r["part"], r["row"]) for r in doc["rows"] if r["status"] == "ok"}
    assert {(r["part"], r["row"]) for r in finished} <= kept
    markdown = (tmp_path / "check.md").read_text()
    assert all(f"| {row} | 1 | ok |" in markdown for part, row in kept if part == "latency, batch 1")
    assert not doc["complete"] and {r["status"] for r in doc["rows"]} & {"running", "pending"}
    assert "NOT complete" in markdown
    started = [p for p in doc["parts"] if "pid" in p]
    time.sleep(0.5)
    assert started and not [p for p in started if alive(p["pid"])], started  # no part outlives the check


# --- the plan with stand-in parts: a timeout, absent data, the rest intact ---


def stand_in(rows: list[str], then: str = "") -> list[str]:
    """A part's process that prints an ok row for each label, then runs `then` (Python)."""
    lines = "".join(f"print({budget.ROW + json.dumps({'row': r, 'status': 'ok', 'median_ms': 1.0})!r})\n"
                    for r in rows)
    return [sys.executable, "-c", lines + then]


def test_a_part_out_of_time_is_a_row_that_says_so_and_the_rest_is_intact(tmp_path, monkeypatch, capsys):
    """The large-batch latency part prints two of its four rows and hangs: it is stopped at its timeout (its
    share of the budget), its two finished rows stay, the other two say it timed out; the parts after it
    run. With no data found, the train.py run is a row that says so, not a silent skip."""
    real_parts = bench.check_parts

    def stand_ins(args, device, sizes, run_dir):
        parts = real_parts(args, device, sizes, run_dir)
        for part in parts:
            if part.argv:
                hang = part.name == "latency, batch 4"
                part.argv = stand_in(part.rows[:2] if hang else part.rows or ["stand-in"],
                                     "import time; time.sleep(600)" if hang else "")
                part.parse = budget.parse_rows
        return parts

    def no_data(name, data_dir="", download=False):
        raise FileNotFoundError(name)

    monkeypatch.setattr(bench, "check_parts", stand_ins)
    monkeypatch.setattr(bench.data, "find_builtin", no_data)
    start = time.monotonic()
    assert not bench.main(["check", "--device", "cpu", "--budget", "10", "--out", str(tmp_path)])["ok"]
    assert time.monotonic() - start < 10
    rows = {(r["part"], r["row"]): r for r in report(tmp_path)["rows"]}
    large = [rows[("latency, batch 4", label)] for label in bench.LATENCY_MODELS]
    assert [r["status"] for r in large] == ["ok", "ok", "timed out", "timed out"]
    timeout = next(p for p in report(tmp_path)["parts"] if p["part"] == "latency, batch 4")["timeout_s"]
    assert large[2]["detail"] == f"timed out after {timeout:.0f} s (its share of the budget)"
    stopped_after = next(p for p in report(tmp_path)["parts"] if p["part"] == "latency, batch 4")["seconds"]
    assert timeout >= 0.22 * 10 and abs(stopped_after - timeout) < 1  # at least its share; stopped on time
    assert all(rows[("latency, batch 1", label)]["status"] == "ok" for label in bench.LATENCY_MODELS)
    assert rows[("training step", "reViT fixed")]["status"] == rows[("correctness", "stand-in")]["status"] == "ok"
    no_data = rows[("train.py run", "train.py run")]
    assert no_data["status"] == "not run" and re.search(r"no Fashion-MNIST in .*copy its four \.gz files", no_data["detail"])
    markdown = (tmp_path / "check.md").read_text()
    assert "| reViT cached | – | **timed out**: timed out after" in markdown and "**not run**: no Fashion" in markdown
    assert "latency, batch 4 | reViT cached | timed out | timed out after" in capsys.readouterr().out


def test_sigterm_stops_the_running_part_and_leaves_a_report_that_says_so(tmp_path, monkeypatch):
    """The large-batch latency part prints two rows, waits until the report holds them, then SIGTERMs the check
    (as a command limit would) and hangs: the check stops that part (its process group), marks its other
    rows stopped and the later parts not run, writes the report and exits with the reason."""
    real_parts = bench.check_parts
    wait_then_stop = (f"import json, os, pathlib, signal, time\npath = pathlib.Path({str(tmp_path / 'check.json')!r})\n"
                      "while sum(r['status'] == 'ok' for r in json.loads(path.read_text())['rows']) < 6:\n"
                      "    time.sleep(0.05)\nos.kill(os.getppid(), signal.SIGTERM)\ntime.sleep(600)\n")

    def stand_ins(args, device, sizes, run_dir):
        parts = real_parts(args, device, sizes, run_dir)
        for part in (p for p in parts if p.argv):
            stop = part.name == "latency, batch 4"
            part.argv = stand_in(part.rows[:2] if stop else part.rows, wait_then_stop if stop else "")
            part.parse = budget.parse_rows
        return parts

    monkeypatch.setattr(bench, "check_parts", stand_ins)
    with pytest.raises(SystemExit) as stopped:
        bench.main(["check", "--device", "cpu", "--budget", "60", "--out", str(tmp_path)])
    assert str(stopped.value.code).startswith("bench.py check: stopped (SIGTERM after ")
    doc = report(tmp_path)
    statuses = [r["status"] for r in doc["rows"] if r["part"] == "latency, batch 4"]
    assert statuses == ["ok", "ok", "stopped", "stopped"] and doc["complete"] and not doc["ok"]
    assert all(r["status"] == "ok" for r in doc["rows"] if r["part"] == "latency, batch 1")
    assert {r["status"] for r in doc["rows"][8:]} == {"not run"}
    stopped_part = next(p for p in doc["parts"] if p["part"] == "latency, batch 4")
    assert stopped_part["status"] == "stopped" and not alive(stopped_part["pid"])
    assert "| reViT cached | – | **stopped**: the check was stopped (SIGTERM" in (tmp_path / "check.md").read_text()


def test_a_part_not_started_for_lack_of_time_says_so():
    """The floor: a part whose time would be under it is not started, and its rows say how much was left."""
    out = budget.Report("/nonexistent", {}, str, str)
    out.write = lambda: None
    parts = [budget.Part("slow", stand_in([], "import time; time.sleep(600)"), ["a"], share=0.5),
             budget.Part("next", stand_in(["b"]), ["b"], share=0.5, floor=100.0)]
    with open(os.devnull, "w") as log:
        budget.run_plan(parts, 2, out, log)
    assert [r["status"] for r in out.rows] == ["timed out", "not run"]
    assert out.rows[1]["detail"] == "1 s of the 2 s budget left for it, it needs 100 s"


def test_an_out_folder_holding_another_check_s_report_is_refused_and_left_as_it_is(tmp_path):
    (tmp_path / "check.json").write_text("{}")
    (tmp_path / "ckpt.pt").write_bytes(b"another run's")
    with pytest.raises(SystemExit) as error:
        bench.main(["check", "--device", "cpu", "--out", str(tmp_path)])
    assert str(error.value.code) == (f"bench.py: error: --out {tmp_path} already holds check.json (another "
                                     "check's report); choose another --out")
    assert (tmp_path / "check.json").read_text() == "{}" and (tmp_path / "ckpt.pt").read_bytes() == b"another run's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["check.json", "ckpt.pt"]


def test_a_read_only_working_folder_is_one_line_before_anything_runs(tmp_path, monkeypatch):
    """The default --out (out/check-TIME) lies under the working folder: where that folder cannot be written
    (a read-only mount; root passes chmod, so the kernel's answer is stood in for), one line, nothing made."""
    import lib.cli
    read_only = tmp_path.resolve()
    real_access = os.access
    monkeypatch.setattr(lib.cli.os, "access", lambda path, mode: real_access(path, mode) and not (
        mode & os.W_OK and Path(path).resolve() == read_only))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(bench.COMMANDS, "check", lambda *a: pytest.fail("the check started"))
    with pytest.raises(SystemExit) as error:
        bench.main(["check", "--device", "cpu", "--quick"])
    assert re.fullmatch(rf"bench.py: error: --out out/check-\d{{8}}-\d{{6}} cannot be created: {read_only} is not "
                        "a writable folder", str(error.value.code)), error.value.code
    assert list(tmp_path.iterdir()) == []


def test_the_commit_comes_from_a_file_where_there_is_no_git(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "git_commit", lambda folder: None)
    monkeypatch.setattr(bench, "HERE", str(tmp_path))
    assert "git" not in bench.environment(bench.torch.device("cpu"))
    (tmp_path / ".commit").write_text("0123abc" * 5 + "01234-dirty\n")
    assert bench.environment(bench.torch.device("cpu"))["git"] == "0123abc" * 5 + "01234-dirty (from .commit)"
    (tmp_path / ".commit").write_text("not a commit; rm -rf /\n")
    assert "git" not in bench.environment(bench.torch.device("cpu"))


def test_the_gpu_report_reads_real_rows_and_judges_them_against_table_7(tmp_path):
    """check.md at full sizes (what the GPU run returns), from rows bench_latency and bench_train really emit
    (here on the CPU, tiny): every column fills, and the targets against the paper's Table 7 appear."""
    rows = []

    def collect(part):
        return lambda label, row, final: rows.append({"part": part, "row": label, "status": "ok", **row}) if final \
            else None

    cpu = bench.torch.device("cpu")
    bench.bench_latency(size="mini", batches=(1,), modes=("compiled",), warmup=0, repeats=2, backend="eager",
                        memory=False, on_row=collect("latency, batch 1"), model_args=bench.TINY_MODELS)
    for r in rows:
        r.update(memory_mib=10.0, memory_ratio=0.5)  # measured on CUDA only
    bench.bench_train(size="mini", batch=2, labels=["DeiT III", "reViT fixed"], warmup=0, repeats=2,
                      on_row=collect("training step"), model_args=bench.TINY_MODELS)
    kinds = {"latency, batch 1": "latency", "training step": "train"}
    doc = {"env": bench.environment(cpu), "sizes": "full", "budget_s": 420.0, "tf32": "TF32 on", "kinds": kinds,
           "parts": [], "rows": rows, "complete": True, "ok": True}
    text = bench.check_markdown(doc)
    assert "| reViT cached | 1 | ok | " in text and "| 10.0 | 0.50 |" in text and "| reViT fixed | 2 | ok | " in text
    assert "### Targets (ours, against the paper's Table 7)" in text and "reViT dynamic memory <= 0.55x" in text
    assert "train step reViT fixed <= 1.10x DeiT III" in text


def test_the_gpu_plan(tmp_path, fashion_mnist_dir):
    """What the parts of a CUDA check run (built here without a GPU: nothing is started): full sizes, most
    important first, inductor, the gpu-marked tests, the GPU the check was given as each part's only one."""
    args = bench.build_parser().parse_args(["check", "--device", "cuda:1", "--data-dir", str(fashion_mnist_dir)])
    parts = bench.check_parts(args, bench.torch.device("cuda", 1), bench.CHECK_SIZES["full"], str(tmp_path))
    assert [p.name for p in parts] == ["latency, batch 1", "latency, batch 64", "training step", "correctness",
                                       "train.py run", "training step, elastic depth", "GPU tests that need the data"]
    assert abs(sum(p.share for p in parts) - 1) < 1e-9 and all(0 < p.floor < p.share * 420 for p in parts)
    assert all(p.argv and not p.blocked for p in parts)
    assert parts[0].argv[-4:] == ["--device", "cuda", "--part", "latency:1"] and parts[1].argv[-1] == "latency:64"
    markers = [b for a, b in zip(parts[3].argv, parts[3].argv[1:]) if a == "-m"]  # python -m pytest ... -m gpu
    assert markers == ["pytest", "gpu"] and parts[6].argv[-2:] == [
        str(ROOT / "tests" / "test_train.py"), str(ROOT / "tests" / "test_analyze.py")]
    assert parts[0].env["CUDA_VISIBLE_DEVICES"] == "1" and parts[0].env["REVIT_GPU_TESTS"] == "1"
    assert parts[0].env["REVIT_DATA_DIR"] == str(fashion_mnist_dir)
    run = parts[4].argv
    assert run[run.index("--arch") + 1] == "revit-s" and run[run.index("--data-dir") + 1] == str(fashion_mnist_dir)
    assert run[run.index("--out-dir") + 1] == str(tmp_path) and "--compile-backend" in run
