"""Checkpoint files in one process: round trip, keep-last-K, and corrupt or partial checkpoints
(truncated file, flipped byte, missing manifest, leftover .tmp) refused in one line while older
checkpoints stay intact and loadable."""
import re

import pytest
import torch

from tessera.errors import TesseraError
from tessera.models import build_model
from tessera.runtime.checkpoint import MANIFEST, CheckpointManager
from tests.dist.pipeline_checkpoint_common import TINY_LLAMA, global_batch, loss_fn, make_optimizer


def _train(model, opt, steps):
    for step in range(steps):
        tokens, labels = global_batch(step)
        loss_fn(model(tokens), labels).backward()
        opt.step()
        opt.zero_grad()


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fresh():
    model = build_model(TINY_LLAMA, seed=7)
    return model, make_optimizer(model.parameters())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints at steps 1, 2, 3 with keep=2: step-1 is pruned."""
    directory = tmp_path_factory.mktemp("ckpt")
    model = build_model(TINY_LLAMA, seed=0)
    opt = make_optimizer(model.parameters())
    manager = CheckpointManager(directory, keep=2)
    snapshots = {}
    for step in (1, 2, 3):
        _train(model, opt, 1)
        manager.save(step, [model], [opt], {"data_position": 10 * step, "rng": torch.get_rng_state()})
        snapshots[step] = (_params(model), {k: v["exp_avg"].clone() for k, v in opt.state_dict()["state"].items()})
    return directory, snapshots


def test_round_trip_restores_model_optimizer_and_extra_state(saved):
    directory, snapshots = saved
    manager = CheckpointManager(directory, keep=2)
    assert [p.name for p in manager.checkpoints()] == ["step-2", "step-3"]
    assert manager.latest().name == "step-3"
    model, opt = _fresh()
    extra = manager.load([model], [opt])
    assert extra["data_position"] == 30 and extra["step"] == 3 and isinstance(extra["rng"], torch.Tensor)
    params, exp_avg = snapshots[3]
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, params[k], rtol=0, atol=0)
    for k, v in opt.state_dict()["state"].items():
        torch.testing.assert_close(v["exp_avg"], exp_avg[k], rtol=0, atol=0)


def _copy_of(directory, tmp_path):
    import shutil

    target = tmp_path / "ckpt"
    shutil.copytree(directory, target)
    return CheckpointManager(target, keep=2), target


def _assert_refused_and_older_loads(manager, ckpt, message, snapshots):
    model, opt = _fresh()
    before = _params(model)
    with pytest.raises(TesseraError) as err:
        manager.load([model], [opt])
    text = str(err.value)
    assert "\n" not in text and re.search(message, text), text
    assert text.startswith(f"checkpoint {ckpt} is corrupt: ")
    for k, v in model.state_dict().items():  # nothing was touched
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert manager.load([model], [opt], path=manager.directory / "step-2")["step"] == 2
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, snapshots[2][0][k], rtol=0, atol=0)


def test_truncated_file_is_refused(saved, tmp_path):
    directory, snapshots = saved
    manager, root = _copy_of(directory, tmp_path)
    ckpt = root / "step-3"
    victim = next(p for p in sorted(ckpt.iterdir()) if p.suffix == ".distcp")
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    _assert_refused_and_older_loads(manager, ckpt, rf"file {victim.name} has {size // 2} bytes, manifest says {size}",
                                    snapshots)
    assert victim.stat().st_size == size // 2  # the evidence is left as it was


def test_flipped_byte_and_missing_manifest_are_refused(saved, tmp_path):
    directory, snapshots = saved
    manager, root = _copy_of(directory, tmp_path)
    ckpt = root / "step-3"
    victim = ckpt / "extra" / "rank-00000.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    _assert_refused_and_older_loads(manager, ckpt, r"file extra/rank-00000.pt does not match its checksum", snapshots)
    (ckpt / MANIFEST).unlink()
    _assert_refused_and_older_loads(manager, ckpt, rf"{MANIFEST} is missing", snapshots)


def test_leftover_tmp_from_a_crash_is_never_loaded_and_is_replaced(saved, tmp_path):
    directory, snapshots = saved
    manager, root = _copy_of(directory, tmp_path)
    crashed = root / "step-4.tmp"
    crashed.mkdir()
    (crashed / "__0_0.distcp").write_bytes(b"half a checkpoint")
    assert manager.latest().name == "step-3"
    model, opt = _fresh()
    assert manager.load([model], [opt])["step"] == 3
    _train(model, opt, 1)
    manager.save(4, [model], [opt], {"data_position": 40})
    assert not crashed.exists()
    assert [p.name for p in manager.checkpoints()] == ["step-3", "step-4"]
    fresh, fresh_opt = _fresh()
    assert manager.load([fresh], [fresh_opt])["data_position"] == 40


def test_async_save_finishes_on_wait(tmp_path):
    model, opt = _fresh()
    _train(model, opt, 1)
    manager = CheckpointManager(tmp_path, async_save=True)
    manager.save(5, [model], [opt], {"data_position": 5})
    expected = _params(model)
    _train(model, opt, 1)  # training goes on while the files are written
    manager.wait()
    assert manager.latest().name == "step-5" and not (tmp_path / "step-5.tmp").exists()
    fresh, fresh_opt = _fresh()
    manager.load([fresh], [fresh_opt])
    for k, v in fresh.state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=0)


def test_missing_directory_is_one_line():
    with pytest.raises(TesseraError, match="no checkpoint to resume from in nowhere"):
        CheckpointManager("nowhere").load([build_model(TINY_LLAMA)], None)


def test_tied_checkpoint_loads_into_an_untied_pipeline_head(tmp_path):
    """GPT-2 saved whole (head tied to the embedding) resumes as the last chunk of a pipeline,
    whose head is an untied copy: weights and AdamW state come under `output.weight`."""
    from tessera.runtime.pipeline import split_model
    from tests.dist.pipeline_checkpoint_common import TINY_GPT2, make_plan

    model = build_model(TINY_GPT2, seed=0)
    opt = make_optimizer(model.parameters())
    _train(model, opt, 2)
    CheckpointManager(tmp_path).save(2, [model], [opt], {})
    (head,) = split_model(build_model(TINY_GPT2, seed=5), make_plan(TINY_GPT2, world=2, pp=2), 1)
    head_opt = make_optimizer(head.parameters())
    CheckpointManager(tmp_path).load([head], [head_opt])
    tied = model.tok_embeddings.weight
    torch.testing.assert_close(head.output.weight, tied, rtol=0, atol=0)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(head_opt.state[head.output.weight][key], opt.state[tied][key], rtol=0, atol=0)


def test_checkpoint_of_another_model_is_one_line(saved):
    directory, _ = saved
    bigger = build_model(TINY_LLAMA.model_copy(update={"num_layers": 6}))
    with pytest.raises(TesseraError) as err:
        CheckpointManager(directory).load([bigger], [make_optimizer(bigger.parameters())])
    text = str(err.value)
    assert "\n" not in text and "does not fit this model" in text and "layers.4" in text, text


def test_one_optimizer_over_several_chunks_round_trips_with_a_whole_model(tmp_path):
    """A rank running interleaved chunks with one optimizer (as the trainer does) saves under the
    full model's names: a whole model loads it, and its checkpoint loads back into the chunks."""
    from tessera.runtime.pipeline import split_model
    from tests.dist.pipeline_checkpoint_common import make_plan

    plan = make_plan(TINY_LLAMA, world=2, pp=2, schedule="interleaved_1f1b", virtual_stages=2)
    source = build_model(TINY_LLAMA, seed=0)
    opt = make_optimizer(source.parameters())
    _train(source, opt, 2)
    parts = split_model(source, plan, 0) + split_model(source, plan, 1)  # all 4 chunks, one optimizer
    CheckpointManager(tmp_path / "chunks").save(2, parts, opt, {})
    whole, whole_opt = _fresh()
    CheckpointManager(tmp_path / "chunks").load([whole], whole_opt)
    for (name, a), b in zip(source.named_parameters(), whole.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(whole_opt.state[b]["exp_avg_sq"], opt.state[a]["exp_avg_sq"], rtol=0, atol=0)
    CheckpointManager(tmp_path / "whole").save(2, [whole], whole_opt, {})
    target = build_model(TINY_LLAMA, seed=3)
    chunks = split_model(target, plan, 0) + split_model(target, plan, 1)
    chunk_opt = make_optimizer([p for c in chunks for p in c.parameters()])
    CheckpointManager(tmp_path / "whole").load(chunks, chunk_opt)
    for a, b in zip(source.parameters(), target.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        torch.testing.assert_close(chunk_opt.state[b]["exp_avg"], opt.state[a]["exp_avg"], rtol=0, atol=0)
