"""Bad input, fuzzed (hypothesis): CLI flags of `tessera plan` and `tessera train`, Hugging Face
config.json files, plan files, cluster files and data files. Whatever the input: no traceback (an
exception other than the one-line refusal), no hang (each case has a deadline), and the kinds of
input that must be refused are refused (exit code 2), never silently accepted.

`tessera train` is checked up to the point where it would start processes (`prepare`), so no
case trains; the multi-rank refusal shown once is in test_resilience_dist.py.
"""
from __future__ import annotations

import contextlib
import io
import json
import signal

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.cli import main
from tessera.errors import TesseraError

DEADLINE_S = 20
FUZZ = settings(max_examples=30, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

NASTY_INTS = st.sampled_from([0, -1, -(10**6), 10**9, 10**12, 10**18, 2**63])
NASTY_FLOATS = st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1e308", "-0", "1e-320"])
GARBAGE = st.sampled_from(["", " ", "abc", "1.5", "0x10", "1e3", "--", "None", "[]", "é", "\x00"])


class Hang(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: int = DEADLINE_S):
    def fire(signum, frame):
        raise Hang(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_cli(argv: list[str]) -> tuple[int, str]:
    """Exit code and stderr of `tessera <argv>` in this process (argparse's own exit is code 2)."""
    err = io.StringIO()
    with deadline(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse refuses a malformed flag
            code = e.code if isinstance(e.code, int) else 2
    return code, err.getvalue()


def refused(argv: list[str]) -> str:
    code, err = run_cli(argv)
    assert code == 2, f"accepted: tessera {' '.join(argv)}"
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines and "Traceback" not in err, err
    return lines[-1]


# --- tessera plan ---------------------------------------------------------------------------------

PLAN_FLAGS = {"--gpus": NASTY_INTS, "--gpus-per-node": NASTY_INTS, "--global-batch": NASTY_INTS,
              "--seq-len": NASTY_INTS, "--memory-margin": NASTY_FLOATS, "--dp": NASTY_INTS, "--tp": NASTY_INTS,
              "--pp": NASTY_INTS, "--micro-batch-size": NASTY_INTS, "--virtual-stages": NASTY_INTS}


@FUZZ
@given(flag=st.sampled_from(sorted(PLAN_FLAGS)), data=st.data())
def test_plan_flags(flag, data):
    value = data.draw(st.one_of(PLAN_FLAGS[flag], GARBAGE))
    argv = ["plan", "--model", "tiny-llama", "--gpus", "8", "--gpus-per-node", "8", "--global-batch", "16",
            "--seq-len", "128", flag, str(value)]
    code, err = run_cli(argv)
    assert code in (0, 2) and "Traceback" not in err, err
    bad_number = str(value) in ("0", "-1", "-1000000", "nan", "inf", "-inf", "1e308", "-0", "1e-320")
    if flag in ("--gpus-per-node", "--global-batch", "--seq-len", "--gpus") and bad_number:
        assert code == 2, f"silently accepted {flag} {value}"
    if flag == "--memory-margin" and str(value) in ("nan", "inf", "-inf", "-1", "1e308"):
        assert code == 2, f"silently accepted {flag} {value}"


# --- tessera train (its checks, up to starting processes) -------------------------------------------

TRAIN_BAD = {"--nproc": ["0", "-1", "100000000"], "--steps": ["-1", "-100"],
             "--lr": ["nan", "inf", "-1", "0"], "--grad-clip": ["-1", "nan", "inf"], "--warmup": ["-1"],
             "--global-batch": ["0", "-4", "1000000000000"], "--seq-len": ["0", "-1", "1000000000000"],
             "--checkpoint-every": ["-1"], "--log-every": ["0", "-1"], "--max-restarts": ["-1"],
             "--hang-timeout": ["0", "nan", "-5", "inf"], "--max-bad-steps": ["0"], "--nnodes": ["0", "-2"],
             "--rdzv-endpoint": ["nohost", "h:0", "h:99999", ":1"], "--seed": ["-1", "1e3"],
             "--data": ["/no/such/dir"], "--resume": ["/no/such/ckpt"]}


@FUZZ
@given(flag=st.sampled_from(sorted(TRAIN_BAD)), data=st.data())
def test_train_flags_are_refused_before_anything_starts(flag, data):
    value = data.draw(st.sampled_from(TRAIN_BAD[flag]))
    argv = ["train", "--model", "tiny-llama", "--synthetic-data", "--check", flag, value]
    if flag != "--nproc":
        argv += ["--nproc", "2"]
    line = refused(argv)
    assert line.startswith("tessera train: error:") or "usage:" in line or "argument" in line, line


# --- run config files (TOML): the recovery fields and their neighbours --------------------------------

RUN_CONFIG_BAD = {("recovery", "hang_timeout"): [0, -5, "10", float("nan"), float("inf"), True],
                  ("recovery", "max_restarts"): [-1, 1.5, "3"], ("recovery", "on_nonfinite"): ["ignore", 1],
                  ("recovery", "max_bad_steps"): [0, -1], ("recovery", "replan"): ["no", 0],
                  ("plan", "nnodes"): [0, 2, 10**9], ("plan", "rdzv_endpoint"): ["nohost", "h:0", ":1", "h:99999"],
                  ("plan", "rdzv_id"): ["bad id!", ""], ("checkpoint", "asynchronous"): ["no", 1],
                  ("train", "seed"): [-1], ("data", "seq_len"): [10**12], ("plan", "nproc"): [0, 10**8]}


@FUZZ
@given(field=st.sampled_from(sorted(RUN_CONFIG_BAD)), data=st.data())
def test_run_config_files(tmp_path, field, data):
    from tessera.config import _toml_value

    value = data.draw(st.sampled_from(RUN_CONFIG_BAD[field]))
    path = tmp_path / "run.toml"
    path.write_text(f"[{field[0]}]\n{field[1]} = {_toml_value(value)}\n")
    line = refused(["train", "--config", str(path), "--model", "tiny-llama", "--synthetic-data", "--check"])
    assert line.startswith("tessera train: error:") and f"{field[0]}.{field[1]}" in line, line


def test_run_config_sets_the_recovery_fields(tmp_path):
    from tessera.cli.launch import runtime_options
    from tessera.config import load_config

    path = tmp_path / "run.toml"
    path.write_text('[recovery]\nmax_restarts = 0\nhang_timeout = 30\non_nonfinite = "rollback"\n'
                    'max_bad_steps = 5\nreplan = false\n[checkpoint]\nasynchronous = false\nresume = "auto"\n'
                    '[plan]\nnnodes = 2\nrdzv_endpoint = "head:29500"\n')
    config = load_config(path)
    options = runtime_options(config, tmp_path)
    assert options["resilience"].hang_timeout_s == 30.0 and options["resilience"].on_nonfinite == "rollback"
    assert options["resilience"].max_bad_steps == 5 and not options["stragglers"].replan
    assert not options["checkpoint_async"] and config.recovery.max_restarts == 0
    assert (config.plan.nnodes, config.plan.rdzv_endpoint, config.checkpoint.resume) == (2, "head:29500", "auto")


# --- Hugging Face config.json -----------------------------------------------------------------------

BASE_CONFIG = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 256, "tie_word_embeddings": False}
CONFIG_VALUES = st.one_of(NASTY_INTS, st.sampled_from(["no", "yes", "abc", None, [], {}, True, 1.5, "64", -0.0,
                                                       float("nan"), 10**9]))


@FUZZ
@given(key=st.sampled_from(sorted(BASE_CONFIG)), value=CONFIG_VALUES)
def test_config_json(tmp_path, key, value):
    cfg = dict(BASE_CONFIG)
    cfg[key] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, err = run_cli(["plan", "--model", str(path), "--gpus", "4", "--gpus-per-node", "4",
                         "--global-batch", "8", "--seq-len", "64"])
    assert code in (0, 2) and "Traceback" not in err, err
    if key == "tie_word_embeddings" and not isinstance(value, bool):
        assert code == 2, f"tie_word_embeddings {value!r} silently read as a boolean"
    if key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads") \
            and (isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value >= 10**9):
        assert code == 2, f"{key} {value!r} silently accepted"


# --- plan files -----------------------------------------------------------------------------------

def _tiny_plan_json() -> dict:
    from tessera.search import manual_plan
    from tessera.spec.hf_config import resolve_model_config
    from tessera.spec.model import ModelSpec
    from tessera.spec.presets.clusters import local_cpu_cluster
    from tessera.spec.workload import Workload

    model = ModelSpec.from_config(resolve_model_config("tiny-llama"))
    plan = manual_plan(model, local_cpu_cluster(2), Workload(global_batch=8, seq_len=64, dtype="fp32"), dp=2,
                       micro_batch_size=4)
    return json.loads(plan.to_json())


PLAN_EDITS = [
    ("workload", "global_batch", [0, -8, 7, 10**12]), ("workload", "seq_len", [0, -1, 10**12]),
    (None, "micro_batch_size", [0, 3, -1]), (None, "num_micro_batches", [0, 3]),
    (None, "batch_shares", [[8, 0], [6, 3], [9], [4, 4, 0]]), (None, "version", [0, 2, "1"]),
    ("cluster", "num_nodes", [0, -1, 10**9]), ("cluster", "gpus_per_node", [0, 3]),
    ("cluster", "device_speeds", [{"5": 0.5}, {"0": 0}, {"0": "fast"}, {"1": float("inf")}]),
    ("model.config", "num_layers", [3, 100, 0]), ("model.config", "hidden", [32, 0]),
    ("model.config", "vocab_size", [10, 0]),     ("pipeline", "degree", [0, 2, 3]), ("pipeline", "stages", [[[0, 3]], [[0, 2], [2, 6]], []]),
]


@FUZZ
@given(edit=st.sampled_from(PLAN_EDITS), data=st.data())
def test_plan_files(tmp_path, edit, data):
    where, key, values = edit
    value = data.draw(st.sampled_from(values))
    plan = _tiny_plan_json()
    node = plan
    for part in (where.split(".") if where else []):
        node = node[part]
    node[key] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    line = refused(["train", "--plan", str(path), "--nproc", "2", "--synthetic-data", "--check"])
    assert line.startswith("tessera train: error:"), line


# --- cluster files --------------------------------------------------------------------------------

@FUZZ
@given(key=st.sampled_from(["num_nodes", "gpus_per_node", "compute_efficiency", "overlap_slowdown",
                            "memory_margin", "fragmentation", "device_speeds", "device"]),
       value=st.one_of(NASTY_INTS, st.sampled_from([None, "x", [], {}, 0.5, float("nan"), {"0": 0.1},
                                                    {"99": 0.5}, {"memory_bytes": -1}])))
def test_cluster_files(tmp_path, key, value):
    from tessera.spec.presets import make_cluster

    cluster = json.loads(make_cluster("h100-80gb", 8, 8).model_dump_json())
    if key == "device" and isinstance(value, dict) and "memory_bytes" in value:
        cluster["device"].update(value)
    else:
        cluster[key] = value
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(cluster, allow_nan=True))
    code, err = run_cli(["plan", "--model", "tiny-llama", "--cluster", str(path), "--global-batch", "16",
                         "--seq-len", "128"])
    assert code in (0, 2) and "Traceback" not in err, err
    if key in ("num_nodes", "gpus_per_node") and (not isinstance(value, int) or value <= 0):
        assert code == 2


# --- data files -----------------------------------------------------------------------------------

DATA_FILES = {
    "a.txt": [b"", b"\xff\xfe\x00bad utf8", b"hello " * 50, b"\x00" * 100],
    "a.jsonl": [b"not json\n", b'{"text": 5}\n', b"[1, 2]\n", b'{"text": "ok"}\n{"txt": "x"}\n', b'"str"\n', b""],
    "a.bin": [b"", b"\x01", b"\xff\xff" * 1000, b"\x01\x00" * 1000],
    "a.npy": ["float", "object", "2d", "negative", "huge", "empty", "garbage"],
}


def _npy(path, kind):
    arrays = {"float": np.linspace(0, 1, 5000), "2d": np.zeros((100, 100), dtype=np.int64),
              "negative": -np.arange(5000), "huge": np.full(5000, 2**40, dtype=np.int64),
              "empty": np.zeros(0, dtype=np.int64)}
    if kind == "object":
        np.save(path, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    elif kind == "garbage":
        path.write_bytes(b"\x93NUMPY garbage")
    else:
        np.save(path, arrays[kind])


@FUZZ
@given(name=st.sampled_from(sorted(DATA_FILES)), data=st.data())
def test_data_files(tmp_path, name, data):
    from tessera.runtime.data import build_dataloader

    content = data.draw(st.sampled_from(DATA_FILES[name]))
    directory = tmp_path / "data"
    directory.mkdir(exist_ok=True)
    for old in directory.iterdir():
        old.unlink()
    path = directory / name
    if name.endswith(".npy"):
        _npy(path, content)
    else:
        path.write_bytes(content)
    with deadline():
        try:
            loader = build_dataloader(directory, seq_len=16, global_batch=2, model_vocab_size=50257)
            batch = next(iter(loader))
            assert batch.tokens.min() >= 0 and batch.tokens.max() < 50257
        except TesseraError as e:
            assert "\n" not in str(e)
    if name.endswith(".npy") and content in ("float", "object", "2d", "negative", "huge", "garbage"):
        with pytest.raises(TesseraError):
            build_dataloader(directory, seq_len=16, global_batch=2, model_vocab_size=50257)


def test_bad_numbers_are_named():
    """The one line names the flag and the value."""
    assert "--lr" in refused(["train", "--model", "tiny-llama", "--lr", "nan", "--check"])
    assert "--gpus-per-node" in refused(["plan", "--gpus-per-node", "0"])
