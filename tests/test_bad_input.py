"""Generated bad input, thrown at every verb and API: the answer is success, or exit code 2 with
one line that says what was wrong (the API: a ``SkipDecodeError``); never a traceback, never a
hang. Nothing the project loads can run code, no write leaves a temporary behind, and
``--overwrite`` removes the old run before anything else."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _train_helpers import make_tiny, one_thread, write_e2e_csv
from skipdecode import atomic
from skipdecode.cli import main
from skipdecode.errors import SkipDecodeError
from skipdecode.evaluation import evaluate
from skipdecode.schedule import SkipSchedule
from skipdecode.training import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]
# every loop below is bounded: a fixed number of examples, no deadline per example
FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# values a user (or a script gone wrong) types: numbers of every kind, words, nothing, other scripts
WORDS = st.sampled_from(["", " ", "nan", "-nan", "inf", "-inf", "1e999", "-1e999", "0x10", "1,2", "1,,2", "abc",
                         "-0", "0", "1", "2", "3.5", "-1", "1e-9", "9" * 30, "☃", "None", "true", "[]", "{}"])
FLAG_VALUES = st.one_of(WORDS, st.integers(-10**20, 10**20).map(str),
                        st.floats(allow_nan=True, allow_infinity=True).map(repr), st.text(max_size=6))
# text with lone surrogates: what Python makes of command-line bytes that are not UTF-8
TEXT = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=12)
JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                        st.lists(st.integers(-3, 40), max_size=3), st.dictionaries(st.text(max_size=3), st.none(),
                                                                                   max_size=2))


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean(code: int, out: str, err: str) -> None:
    """Success, or exit 2 and one line naming the problem; never a traceback."""
    assert "Traceback" not in out + err
    assert code in (0, 2), (code, err)
    if code == 2:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("skipdecode") and ": error: " in lines[0], err


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


GENERATE_FLAGS = ["--speedup", "--max-new-tokens", "--expected-new-tokens", "--temperature", "--top-k", "--top-p",
                  "--seed", "--stop", "--mode", "--system", "--max-num-seqs", "--kv-slots", "--policy", "--dtype"]


@FUZZ
@given(flags=st.dictionaries(st.sampled_from(GENERATE_FLAGS), FLAG_VALUES, max_size=4), prompt=TEXT)
def test_generate_flags_and_prompts(tiny_cli_dir, capsys, flags, prompt):
    argv = ["generate", "--model", str(tiny_cli_dir), "--max-new-tokens", "3"]
    for k, v in flags.items():
        argv += [f"{k}={v}"]
    assert_clean(*run(capsys, argv + ["--", prompt]))


SCHEDULE_KEYS = ["num_layers", "max_exit_layer", "min_exit_layer", "horizon", "warmup_layers", "mode", "junk"]


@FUZZ
@given(fields=st.dictionaries(st.sampled_from(SCHEDULE_KEYS), JSON_VALUES, max_size=6),
       raw=st.one_of(st.none(), st.sampled_from(["", "[]", "{", "NaN", "\x00\xff"])))
def test_schedule_files(tiny_cli_dir, capsys, fields, raw):
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "s.json"
        f.write_text(raw if raw is not None else json.dumps(fields), errors="surrogateescape")
        code, out, err = run(capsys, ["generate", "--model", str(tiny_cli_dir), "--max-new-tokens", "3",
                                      "--schedule", str(f), "hello"])
    assert_clean(code, out, err)
    if raw is not None:
        assert code == 2
    elif code == 0:  # an accepted schedule has integer budgets inside the model
        s = SkipSchedule.from_dict(fields, 6)
        assert all(isinstance(b, int) and 1 <= b <= 6 for b in s.budgets(8))


REQUEST_KEYS = ["prompt", "speedup", "schedule", "max_new_tokens", "arrive_at_step", "mode", "temperature", "top_k",
                "top_p", "seed", "stop", "expected_new_tokens", "other"]


@FUZZ
@given(lines=st.lists(st.one_of(st.dictionaries(st.sampled_from(REQUEST_KEYS), JSON_VALUES, max_size=5).map(
    lambda d: {"prompt": "hi", "max_new_tokens": 2, **d}).map(json.dumps), st.sampled_from(["", "{", "[1]", "null"])),
    min_size=1, max_size=3))
def test_request_files(tiny_cli_dir, capsys, lines):
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "r.jsonl"
        f.write_text("\n".join(lines) + "\n")
        assert_clean(*run(capsys, ["generate", "--model", str(tiny_cli_dir), "--requests", str(f), "--json",
                                   "--kv-slots", "256"]))


TRAIN_FLAGS = ["--steps", "--epochs", "--batch-size", "--grad-accum", "--lr", "--weight-decay", "--warmup-steps",
               "--min-lr-ratio", "--max-grad-norm", "--seed", "--max-length", "--val-groups", "--save-every",
               "--keep-checkpoints", "--lora-r", "--lora-alpha", "--lora-dropout", "--speedups", "--decay",
               "--warmup-layers", "--horizon", "--expected-new-tokens", "--distill", "--distill-temperature",
               "--mode", "--eval-examples"]


@FUZZ
@given(flags=st.dictionaries(st.sampled_from(TRAIN_FLAGS), FLAG_VALUES, min_size=1, max_size=3))
def test_train_flags(tmp_path, capsys, flags):
    # a model that does not exist: a valid command line gets as far as loading it, and no further
    argv = ["train", "--model", str(tmp_path / "no-model"), "--data", "e2e", "-o", str(tmp_path / "run"),
            "--overwrite", "--no-progress"]
    for k, v in flags.items():
        argv += [f"{k}={v}"]
    code, out, err = run(capsys, argv)
    assert_clean(code, out, err)
    assert code == 2  # either the flag or the missing model


@FUZZ
@given(overrides=st.dictionaries(st.sampled_from(["steps", "epochs", "batch_size", "lr", "seed", "lora_r",
                                                  "lora_dropout", "max_grad_norm", "save_every", "speedups",
                                                  "decay", "distill", "val_groups", "max_length", "warmup_steps",
                                                  "keep_checkpoints", "mode", "horizon"]),
                                 JSON_VALUES, min_size=1, max_size=3))
def test_train_api_arguments(tmp_path, overrides):
    """The API raises ``SkipDecodeError`` (the config check, else the missing model), nothing else."""
    with pytest.raises(SkipDecodeError):
        train(TrainConfig(model=str(tmp_path / "no-model"), output_dir=str(tmp_path / "run"), overwrite=True,
                          progress=False, **overrides))


@FUZZ
@given(kw=st.dictionaries(st.sampled_from(["limit", "batch_size", "max_new_tokens", "expected_new_tokens",
                                           "horizon", "warmup_layers", "val_groups", "seed", "speedups",
                                           "decay"]),
                          JSON_VALUES, min_size=1, max_size=3))
def test_evaluate_api_arguments(tmp_path, kw):
    with pytest.raises(SkipDecodeError):
        evaluate("e2e", ROOT.parent / "shared" / "data" / "e2e" / "devset.csv", str(tmp_path / "no-model"),
                 bertscore=False, **kw)


@FUZZ
@given(kw=st.dictionaries(st.sampled_from(["speedup", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
                                           "stop", "expected_new_tokens", "mode"]), JSON_VALUES, max_size=3),
       prompt=st.one_of(TEXT, JSON_VALUES))
def test_llm_generate_arguments(tiny_cli_dir, kw, prompt):
    llm = _llm(tiny_cli_dir)
    try:
        outs = llm.generate([prompt], **{"max_new_tokens": 3, **kw})
    except SkipDecodeError as e:
        assert str(e) and "\n" not in str(e)
        return
    assert len(outs) == 1 and isinstance(outs[0].text, str)


_LLMS: dict = {}


def _llm(path):
    from skipdecode import LLM

    if path not in _LLMS:
        _LLMS[path] = LLM.load(path)
    return _LLMS[path]


# -- nothing the project loads runs code ------------------------------------------------------------
def test_every_torch_load_in_the_package_is_weights_only_and_nothing_unpickles():
    """A crafted pickle can only run code through pickle or torch.load without weights_only;
    the package has neither (the dynamic checks: test_train's crafted resume files, test_errors'
    crafted .bin checkpoint)."""
    loads = []
    for f in (ROOT / "src" / "skipdecode").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            assert name not in ("pickle.load", "pickle.loads", "cloudpickle.load", "dill.load", "joblib.load",
                                "numpy.load", "np.load"), f"{f}: {name}"
            if name == "torch.load":
                kw = {k.arg: k.value for k in node.keywords}
                assert "weights_only" in kw and ast.literal_eval(kw["weights_only"]) is True, \
                    f"{f}: {ast.unparse(node)}"
                loads.append(f.name)
    assert sorted(set(loads)) == ["checkpoint.py", "state.py"]  # the scan does see the loads there


# -- nothing stale stays behind -------------------------------------------------------------------------
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_killed_writers_temporaries_are_removed_by_the_next_write(tmp_path):
    dead = _dead_pid()
    stale_file = tmp_path / f".model.safetensors.tmp-{dead}-abc"
    stale_dir = tmp_path / f".smollm2.tmp-{dead}-xyz"
    live = tmp_path / f".other.tmp-{os.getpid()}-q"  # a write in progress in this process
    stale_file.write_bytes(b"x" * 1000)
    stale_dir.mkdir()
    (stale_dir / "model.safetensors").write_bytes(b"y")
    live.write_bytes(b"z")
    keep = tmp_path / "notes.tmp-1-keep.txt"  # not ours: no leading dot
    keep.write_text("mine")
    atomic.write_text(tmp_path / "report.json", "{}\n")
    assert not stale_file.exists() and not stale_dir.exists()
    assert live.exists() and keep.exists()
    assert (tmp_path / "report.json").read_text() == "{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, keep.name, "report.json"])


def test_a_killed_gguf_conversion_leaves_nothing_after_the_next_run(tmp_path):
    from skipdecode.checkpoint import default_gguf_path

    cache = tmp_path / "cache"
    env = dict(os.environ, SKIPDECODE_CACHE=str(cache), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    code = "import sys; from skipdecode.checkpoint import resolve; resolve(sys.argv[1])"
    p = subprocess.Popen([sys.executable, "-c", code, str(default_gguf_path())], env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(cache.glob(".*.tmp-*")) and p.poll() is None:
        time.sleep(0.05)
    temps = list(cache.glob(".*.tmp-*"))
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert temps, "the conversion never started writing"
    assert all(t.exists() for t in temps)  # SIGKILL: no handler could remove it
    # the next write in the cache sweeps it (here, a small one: any atomic write there does)
    atomic.write_text(cache / "note.json", "{}")
    assert not any(cache.glob(".*.tmp-*"))


def test_overwrite_removes_the_old_run_before_anything_else(tmp_path):
    model = make_tiny(tmp_path / "m", layers=6)
    data = write_e2e_csv(tmp_path / "e2e.csv")
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "skipdecode.cli", "train", "--model", str(model), "--data", str(data), "-o",
            str(out), "--steps", "4", "--batch-size", "2", "--val-groups", "1", "--eval-examples", "0",
            "--no-progress", "--lora", "--lora-r", "2"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    subprocess.run(argv, env=env, check=True, capture_output=True)
    assert (out / "adapter_config.json").is_file() and (out / "skipdecode.json").is_file()
    # again with --overwrite, killed after its first step: the old, complete-looking run must be gone
    r = subprocess.run(argv + ["--overwrite"], env=dict(env, SKIPDECODE_FAULT="kill_after_step=1"),
                       capture_output=True)
    assert r.returncode == -signal.SIGKILL
    for name in ("adapter_config.json", "adapter_model.safetensors", "skipdecode.json", "config.json"):
        assert not (out / name).exists(), name
    assert len((out / "train_log.jsonl").read_text().splitlines()) == 1  # the new run's log only
    r = subprocess.run(argv, env=env, capture_output=True, text=True)  # neither flag: refused, not mixed
    assert r.returncode == 2 and "--resume" in r.stderr and "Traceback" not in r.stderr
    both = subprocess.run(argv + ["--resume", "--overwrite"], env=env, capture_output=True, text=True)
    assert both.returncode == 2 and "give one of them" in both.stderr


def test_an_output_path_that_is_a_file_is_refused_before_any_work(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    code, out, err = run(capsys, ["train", "--model", "default", "--data", "e2e", "-o", str(f)])
    assert code == 2 and "is a file" in err
    code, out, err = run(capsys, ["evaluate", "--task", "e2e", "--data", "x.csv", "--out", str(f / "r.json")])
    assert_clean(code, out, err)
    assert code == 2


def test_a_stop_given_as_one_string_is_one_stop_string(tiny_cli_dir):
    from skipdecode.tokenization import Detokenizer

    llm = _llm(tiny_cli_dir)
    assert Detokenizer(llm.tokenizer, "ab").stops == ["ab"]
    assert Detokenizer(llm.tokenizer, "").stops == []
    assert llm.engine().make_request([1, 2, 3], max_new_tokens=4, stop="ab").stop == ("ab",)
