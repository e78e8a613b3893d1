"""Shared test fixtures: where the real data lives, and a small CPU budget.

Data is never downloaded at test time. Fashion-MNIST is searched in ./data (of the repository),
$REVIT_DATA_DIR and Debian's /usr/share/datasets (`apt-get install dataset-fashion-mnist`, what
README's set-up installs); tests that need it are skipped with the reason when none has it.
The language-model tests train on the corpus the repository generates (data.grammar_corpus);
the tinyshakespeare test reads $REVIT_DATA_DIR/tinyshakespeare.txt and is skipped without it.

Devices: the suite runs on the CPU, also on a machine with a GPU. Bit-for-bit resume and 2 ranks =
1 rank are promised on the CPU only (bf16 autocast and atomics differ run to run on a GPU), so unless
REVIT_GPU_TESTS=1 the GPUs are hidden (CUDA_VISIBLE_DEVICES="", set here before torch initialises
CUDA, inherited by torchrun and every subprocess): --device auto is the CPU everywhere. Tests marked
`gpu` need a CUDA GPU and run only with REVIT_GPU_TESTS=1 on a machine that has one:

    REVIT_GPU_TESTS=1 python -m pytest -q -m gpu

With REVIT_GPU_TESTS=1 the unmarked tests still see no GPU (`cpu_unless_marked_gpu` below).

Two commands (README, "Tests"): `python -m pytest -q` runs the fast set, the papers' checks;
`python -m pytest -q -m deep` runs the rest. A file or test named on the command line runs whole, both sets
(`python -m pytest -q tests` is everything). Which set a test is in is decided here, by its file and, for
the exceptions, its name (FAST_FILES, DEEP_FILES, DEEP_TESTS, FAST_TESTS below), so a test keeps its set
when the file around it changes; tests/test_layout.py checks every file is in exactly one list.
"""
import os
import subprocess
import sys
from pathlib import Path

GPU_TESTS = os.environ.get("REVIT_GPU_TESTS") == "1"
if not GPU_TESTS:  # before torch reads it: CUDA initialises lazily, at its first use
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# One intra-op thread, here and in every process a test starts, unless the user chose: the models are tiny,
# and on a busy machine spinning OpenMP threads made the suite twice as slow. Before torch reads it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

try:
    import torch  # noqa: E402
except ModuleNotFoundError as missing:  # a python without README's set-up: say so in one line, not per test file
    pytest.exit(f"the tests need the packages of requirements.txt, and {missing.name!r} is not installed for "
                f"{sys.executable}: python -m pip install -r requirements.txt (README's set-up, in its .venv)",
                returncode=4)

ROOT = Path(__file__).resolve().parent.parent
SKIP_GPU = ("needs a CUDA GPU: run with REVIT_GPU_TESTS=1 on a machine that has one" if not GPU_TESTS else
            "REVIT_GPU_TESTS=1 but torch sees no CUDA GPU")


# The fast set: every equation against its float64 reference, the models' Hypothesis properties, fold,
# elastic depth and the merges against their references, forward/backward, a tiny run that resumes
# bit-exactly, the exports' exactness, and one bad-input line per entry point.
FAST_FILES = ("test_equations.py", "test_revit.py", "test_alternet.py", "test_moe.py", "test_train.py",
              "test_export.py", "test_data.py", "test_planted.py", "test_sample.py", "test_weights.py",
              "test_cli.py")
# The deep set: the hostile tables, faults and kills, compile and device tests, the tools end to end,
# memory and timing, the GPU check, the layout and results checks.
DEEP_FILES = ("test_hostile.py", "test_faults.py", "test_device.py", "test_analyze.py", "test_depths.py",
              "test_probes.py", "test_sweep.py", "test_bench.py", "test_memory.py", "test_layout.py",
              "test_results.py", "test_mutants.py", "test_install.py", "test_plot.py")
# Deep tests in fast files (every parametrisation of the named function): compile, devices, processes
# started from scratch (each imports torch again), ranks and crashes.
DEEP_TESTS = (
    "test_alternet.py::test_torch_compile_training_step_matches_eager",
    "test_alternet.py::test_a_compiled_generate_step_halts_as_eager",
    "test_alternet.py::test_compiled_training_recompiles_only_when_the_curriculum_depth_changes",
    "test_alternet.py::test_bf16_autocast_forward_backward_close_to_fp32",
    "test_revit.py::test_importing_revit_installs_no_hook_and_imports_no_comparison",
    "test_sample.py::test_script_samples_reproducibly_with_iteration_marks",
    "test_sample.py::test_script_errors_are_one_line_without_traceback",
    "test_export.py::test_command_line_prints_no_traceback",
    "test_train.py::test_ddp_two_processes_match_single_process",
    "test_train.py::test_the_suite_runs_on_the_cpu_by_default",
    "test_train.py::test_command_line_exit_code",
    "test_train.py::test_rng_state_of_this_gpu_only",
    "test_train.py::test_more_ranks_than_gpus_is_one_line",
    "test_train.py::test_atomic_save_survives_a_crash",
    "test_train.py::test_crash_during_checkpoint_keeps_last_good_one",
    "test_train.py::test_nan_loss_stops_and_keeps_the_good_checkpoint",
    "test_train.py::test_a_failed_save_stops_every_rank",
    "test_train.py::test_device_options_decide_the_cuda_branches",
    "test_train.py::test_device_picker_refuses_what_the_machine_lacks",
    "test_train.py::test_cuda_choices_run_on_cpu",
    "test_train.py::test_a_training_step_reads_the_device_once",
    "test_train.py::test_ddp_wraps_the_model_before_compile",
    "test_train.py::test_data_on_the_device_is_gathered_with_an_index_there",
    "test_train.py::test_nccl_process_group",
    "test_train.py::test_compile_runs_on_cpu",
    "test_train.py::test_depth_evaluation_with_the_model_on_a_device",
    "test_train.py::test_language_evaluation_with_the_model_on_a_device",
    "test_train.py::test_fold_and_its_check_with_the_model_on_a_device",
    "test_train.py::test_training_on_the_gpu",
    "test_train.py::test_a_cpu_run_resumes_on_the_gpu_and_back",
    "test_train.py::test_precision_flag_and_auto_on_the_cpu",
    "test_train.py::test_fp16_on_the_cpu_skips_an_overflow_and_resumes_its_scaler_bit_exactly",
    "test_train.py::test_fp16_training_on_the_gpu",
    "test_train.py::test_resume_applies_this_device_s_fused_choice",
    "test_train.py::test_the_start_event_names_the_commit_torch_device_and_command",
    "test_train.py::test_piped_output_shows_the_loss_on_lines_of_their_own",
    "test_train.py::test_no_progress_prints_the_loss_every_log_interval",
    "test_train.py::test_a_complete_run_resumed_with_nothing_new_says_so_and_trains_nothing",
    "test_train.py::test_extending_a_run_says_how_its_schedule_changes",
)
# Fast tests in deep files: one bad-input table per entry point, and the layout rules a change most often
# breaks.
FAST_TESTS = (
    "test_bench.py::test_hostile_inputs_are_one_line_errors_before_any_work",
    "test_depths.py::test_hostile_inputs_are_one_line_errors_before_any_work",
    "test_sweep.py::test_bad_flags_are_one_line_errors_before_any_work",
    "test_analyze.py::test_bad_input_gives_one_line_and_writes_nothing",
    "test_probes.py::test_bad_input_gives_one_line_and_writes_nothing",
    "test_hostile.py::test_render_refuses_torn_json_and_data_formats",
    "test_layout.py::test_the_model_files_import_nothing_of_the_project",
    "test_layout.py::test_every_test_file_is_in_one_set_and_every_exception_names_a_test",
)


def is_deep(item) -> bool:
    """The set of a collected test: its file's, unless its function is named as an exception."""
    name = f"{item.path.name}::{getattr(item, 'originalname', item.name)}"
    return name in DEEP_TESTS if item.path.name in FAST_FILES else name not in FAST_TESTS


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; runs only with REVIT_GPU_TESTS=1")
    config.addinivalue_line("markers", "deep: the deep set, `python -m pytest -q -m deep` (set here)")


@pytest.hookimpl(tryfirst=True)  # before -m reads the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_deep(item):
            item.add_marker(pytest.mark.deep)
    if not config.option.markexpr and config.args_source != pytest.Config.ArgsSource.ARGS:
        # a bare `python -m pytest`: the fast set
        config.hook.pytest_deselected(items=[item for item in items if is_deep(item)])
        items[:] = [item for item in items if not is_deep(item)]
    if GPU_TESTS and torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason=SKIP_GPU))


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu(request, monkeypatch):
    """With REVIT_GPU_TESTS=1 the GPUs stay visible to the process: an unmarked test still runs on the
    CPU (--device auto picks it, and its subprocesses see no GPU)."""
    if GPU_TESTS and not request.node.get_closest_marker("gpu"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture
def one_thread():
    """One intra-op thread, for tests that time or measure memory (`pytestmark = pytest.mark.usefixtures(
    "one_thread")`): on a shared machine two spinning OpenMP threads can be 20x slower, and one heap arena
    keeps memory peaks repeatable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fetching_tiktoken(monkeypatch):
    """A stand-in tiktoken whose get_encoding tries to connect, as the real one does when its files are not
    cached: the list it returns holds each connection attempt's error (a guard that refuses first leaves
    its own message there)."""
    import socket
    import types
    attempts = []

    def get_encoding(name):
        try:
            socket.create_connection(("openaipublic.blob.core.windows.net", 443), timeout=0.01)
        except OSError as e:
            attempts.append(str(e))
            raise
        raise AssertionError("the stand-in reached past the guard")

    monkeypatch.setitem(sys.modules, "tiktoken", types.SimpleNamespace(get_encoding=get_encoding))
    return attempts


def _data_roots():
    env = os.environ.get("REVIT_DATA_DIR")
    return [ROOT / "data"] + ([Path(env)] if env else []) + [Path("/usr/share/datasets")]


@pytest.fixture(scope="session")
def fashion_mnist_dir():
    for root in _data_roots():
        for d in (root / "fashion-mnist", root):
            if (d / "t10k-labels-idx1-ubyte.gz").exists():
                return d
    pytest.skip("Fashion-MNIST not found in ./data, $REVIT_DATA_DIR or /usr/share/datasets: "
                "`apt-get install dataset-fashion-mnist`")


@pytest.fixture(scope="session")
def shakespeare_path():
    env = os.environ.get("REVIT_DATA_DIR")
    path = Path(env) / "tinyshakespeare.txt" if env else None
    if path is None or not path.is_file():
        pytest.skip("tinyshakespeare.txt not found: set REVIT_DATA_DIR to a folder that holds it "
                    "(python train.py --dataset tinyshakespeare --download --data-dir DIR fetches it)")
    return path


# A tiny training run as a user pipes it, shared by the tests of train.py's records and tools/plot.py.
RECORDED_RUN = ["--arch", "revit-mini", "--device", "cpu", "--train-subset", "256", "--test-subset", "128",
        "--batch-size", "32", "--patch-size", "7", "--depth", "2",
        "--model-args", "dim=32,heads=2,ffn_dim=64", "--max-steps", "8", "--log-interval", "2",
        "--eval-interval", "4"]


@pytest.fixture(scope="session")
def piped_run(tmp_path_factory, fashion_mnist_dir):
    """A tiny run with its progress bar on (the default), stdout and stderr piped into one stream."""
    out = tmp_path_factory.mktemp("runs") / "piped"
    argv = [sys.executable, str(ROOT / "train.py"), *RECORDED_RUN, "--data-dir", str(fashion_mnist_dir),
            "--out-dir", str(out)]
    done = subprocess.run(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:]
    return out, done.stdout
