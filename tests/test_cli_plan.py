"""`tessera plan` and `tessera show` from the command line: output, files, and one-line errors."""
import json
import subprocess
import sys

import pytest

from tessera.cli import main
from tessera.plan import Plan
from tessera.spec.presets import make_cluster

SMALL = ["--model", "llama2-7b", "--gpus", "16", "--global-batch", "64", "--seq-len", "2048"]


def fails(capsys, argv: list[str]) -> str:
    """Run the CLI, expect exit 2 and exactly one line on stderr; return that line."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


# --- errors: one line, exit 2 --------------------------------------------------------------------
def test_unknown_model_lists_the_known_ones(capsys):
    err = fails(capsys, ["plan", "--model", "llama9-1t"])
    assert "unknown model 'llama9-1t'" in err and "llama3-70b" in err and "config.json" in err


def test_missing_config_file_is_named(capsys, tmp_path):
    err = fails(capsys, ["plan", "--model", str(tmp_path / "nowhere" / "config.json")])
    assert "does not exist" in err and "nowhere" in err


def test_unknown_gpu_lists_the_known_ones(capsys):
    err = fails(capsys, ["plan", "--gpu", "b300"])
    assert "unknown GPU 'b300'" in err and "h100-80gb" in err


def test_gpus_must_fill_whole_nodes(capsys):
    err = fails(capsys, ["plan", "--gpus", "12", "--gpus-per-node", "8"])
    assert "--gpus 12 is not a multiple of --gpus-per-node 8" in err


def test_manual_plan_batch_must_divide(capsys):
    err = fails(capsys, ["plan", *SMALL, "--global-batch", "100", "--tp", "2", "--micro-batch-size", "2"])
    assert "global batch 100 is not divisible by dp 8 x micro-batch size 2 = 16" in err


def test_manual_degrees_must_divide_the_gpus(capsys):
    err = fails(capsys, ["plan", *SMALL, "--tp", "3"])
    assert "pp 1 x tp 3 x sp 1 = 3 does not divide 16 GPUs" in err


def test_learned_positions_cap_the_sequence(capsys):
    err = fails(capsys, ["plan", "--model", "gpt2", "--seq-len", "4096"])
    assert "--seq-len 4096 is longer than gpt2's 1024 learned positions" in err


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    (None, "invalid cluster file .*: num_nodes: Input should be greater than 0"),
    (None, "invalid cluster file .*: speed: Extra inputs are not permitted"),
])
def test_invalid_cluster_file(capsys, tmp_path, content, message):
    import re

    good = json.loads(make_cluster("h100-80gb", 16, 8).model_dump_json())
    if content is None:
        good.update({"num_nodes": 0} if "num_nodes" in message else {"speed": 1})
        content = json.dumps(good)
    path = tmp_path / "cluster.json"
    path.write_text(content)
    err = fails(capsys, ["plan", "--cluster", str(path)])
    assert re.search(message, err), err


def test_cluster_file_excludes_gpu_flags(capsys, tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(make_cluster("h100-80gb", 16, 8).model_dump_json())
    err = fails(capsys, ["plan", "--cluster", str(path), "--gpu", "a100-80gb"])
    assert "--cluster already gives the GPU kind" in err


def test_show_refuses_other_versions_and_invalid_plans(capsys, tmp_path):
    path = tmp_path / "plan.json"
    assert "does not exist" in fails(capsys, ["show", str(path)])
    path.write_text(json.dumps({"version": 99}))
    assert "plan version 99 is not supported" in fails(capsys, ["show", str(path)])
    path.write_text(json.dumps({"version": 1, "name": "x"}))
    assert "invalid plan: model: Field required" in fails(capsys, ["show", str(path)])
    path.write_text("{")
    assert "plan is not valid JSON" in fails(capsys, ["show", str(path)])
