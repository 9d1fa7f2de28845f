"""The vision encoder, projector and VLM modules, and the image-text data (one process, CPU)."""
import json

import numpy as np
import pytest
import torch

from tessera.errors import TesseraError
from tessera.models.vision import (build_image_encoder, build_vlm, image_token_id, patchify, scatter_images)
from tessera.runtime.image_data import (IGNORE_INDEX, ImageTextLoader, load_image_text, synthetic_shape)
from tessera.spec.model import TransformerConfig
from tessera.spec.multimodal import VLM_CONFIGS, ProjectorConfig, VisionEncoderConfig, VLMConfig, VLMSpec

LLM = TransformerConfig(name="t-llm", vocab_size=300, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        ffn_hidden=64, max_seq_len=64)
VLM = VLMConfig(name="t-vlm", vision=VisionEncoderConfig(name="t-vit", image_size=16, patch_size=4, hidden=24,
                                                          num_layers=2, num_heads=4, ffn_hidden=48),
                projector=ProjectorConfig(layers=2), llm=LLM)


@pytest.mark.parametrize("name", sorted(VLM_CONFIGS))
def test_modules_have_the_parameters_the_planner_counts(name):
    config = VLM_CONFIGS[name]
    spec = VLMSpec.from_config(config)
    encoder = build_image_encoder(config, device="meta")  # no memory: 70B-class presets too
    vision = sum(p.numel() for p in encoder.vision.parameters())
    projector = sum(p.numel() for p in encoder.projector.parameters())
    assert projector == spec.projector.params
    assert vision == spec.encoder.num_params
    if config.llm.hidden <= 1024:  # the whole model, tiny presets
        model = build_vlm(config, device="meta")
        assert sum(p.numel() for p in model.llm.parameters()) == spec.llm.num_params
        assert sum(p.numel() for p in model.parameters()) == spec.num_params


def test_intern_vit_6b_has_the_public_architecture_s_parameters():
    """InternViT-6B-448px-V1-5: 45 blocks of width 3200 (25 heads, MLP 12800), q/k/v without bias and
    the output projection with one, RMS norms of q and k over all 3200 features, two layer-scale
    vectors; a 14 px patch conv with bias, a class token and 1,025 learned positions."""
    h, f = 3200, 12800
    block = 3 * h * h + (h * h + h) + (h * f + f) + (f * h + h) + 2 * h + 2 * h + 2 * h
    embeddings = 3 * 14 * 14 * h + h + h + 1025 * h
    want = embeddings + 45 * block
    assert want == 5_536_496_000
    config = VLM_CONFIGS["vit6b-llama3-70b"]
    encoder = build_image_encoder(config, device="meta")
    assert sum(p.numel() for p in encoder.vision.parameters()) == VLMSpec.from_config(config).encoder.num_params == want
    assert encoder.vision.layers["0"].attention.q_norm.weight.shape == (h,)


def test_tiny_presets_have_a_small_vocabulary_with_a_spare_image_id():
    for name in ("tiny-vlm", "tiny-qwen2-vl"):
        config = VLM_CONFIGS[name]
        assert config.llm.vocab_size == 320 and config.image_token == 319  # bytes, end-of-text 256, image 319
        batch = next(ImageTextLoader(load_image_text("synthetic-shapes:8"), config, seq_len=64, global_batch=2))
        assert int(batch.tokens.max()) == 319 and int(batch.labels.max()) <= 256


def test_patch_linear_is_the_strided_convolution():
    torch.manual_seed(0)
    images = torch.randn(2, 3, 16, 16)
    conv = torch.nn.Conv2d(3, 8, kernel_size=4, stride=4)
    linear = torch.nn.Linear(3 * 16, 8)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.reshape(8, -1))
        linear.bias.copy_(conv.bias)
    want = conv(images).flatten(2).transpose(1, 2)  # (N, patches row-major, 8)
    torch.testing.assert_close(linear(patchify(images, 4)), want, rtol=1e-5, atol=1e-5)


def test_encoder_attention_is_bidirectional_and_text_loss_only():
    model = build_vlm(VLM, seed=0)
    p, tid = VLM.image_tokens, image_token_id(VLM)
    images = torch.rand(2, 3, 16, 16)
    changed = images.clone()
    changed[:, :, -4:, -4:] += 1.0  # only the last patch
    first = model.vision(images)[:, 1]  # the first patch (after the class token)
    assert not torch.allclose(first, model.vision(changed)[:, 1])  # it sees the last patch
    tokens = torch.randint(0, 256, (2, p + 8))
    tokens[:, :p] = tid
    logits = model(tokens, images)
    assert logits.shape == (2, p + 8, LLM.vocab_size)
    logits.sum().backward()
    assert float(model.llm.tok_embeddings.weight.grad[tid].abs().sum()) == 0.0  # placeholders are replaced
    assert float(model.vision.patch_embed.weight.grad.abs().sum()) > 0
    with pytest.raises(ValueError, match="32 image placeholder tokens .* but 1 images of 16 tokens each"):
        scatter_images(tokens, torch.zeros(1, p, LLM.hidden), tid)
    with pytest.raises(ValueError, match=r"images must be \(N, 3, 16, 16\)"):
        model.vision(torch.zeros(2, 1, 16, 16))


def test_synthetic_shapes_are_deterministic_and_captioned():
    a, caption = synthetic_shape(5, 32, 3)
    b, again = synthetic_shape(5, 32, 3)
    assert np.array_equal(a, b) and caption == again
    words = caption.split()  # "a <size> <colour> <shape> at the <top|bottom> <left|right>"
    colour = {"red": 0, "green": 1, "blue": 2}.get(words[2])
    bright = a.max(0) > 0.5
    rows, cols = np.nonzero(bright)
    assert (rows.mean() < 16) == (words[-2] == "top") and (cols.mean() < 16) == (words[-1] == "left")
    if colour is not None:  # the shape's pixels are strongest in the named channel
        assert a[:, bright].mean(1).argmax() == colour
    captions = {synthetic_shape(i, 32, 3)[1] for i in range(200)}
    assert len(captions) > 40  # 64 captions possible


def test_sequences_hold_image_placeholders_then_caption_with_text_labels_only():
    loader = ImageTextLoader(load_image_text("synthetic-shapes:32"), VLM, seq_len=64, global_batch=4)
    batch = next(loader)
    p, tid = VLM.image_tokens, image_token_id(VLM)
    assert batch.images.shape == (4, 3, 16, 16)
    assert (batch.tokens[:, :p] == tid).all() and not (batch.tokens[:, p:] == tid).any()
    assert (batch.labels[:, :p - 1] == IGNORE_INDEX).all()  # no image token is a target
    text = bytes(int(t) for t in batch.labels[0] if 0 <= t < 256).decode()
    assert text.startswith("a ") and text.split()[-2] in ("top", "bottom")
    assert batch.num_targets == int((batch.labels != IGNORE_INDEX).sum())
    # Rows and image rows are chosen apart (a rank's text block and the images it encodes).
    part = loader.batch_at(0, rows=slice(2, 4), image_rows=[3, 0])
    assert torch.equal(part.tokens, batch.tokens[2:]) and torch.equal(part.images, batch.images[[3, 0]])


def test_a_given_image_token_id_is_what_the_data_and_the_model_use():
    """HF's image_token_index (here 257, not the last id) marks the images in the data and in the splice."""
    vlm = VLM.model_copy(update=dict(image_token_id=257))
    batch = next(ImageTextLoader(load_image_text("synthetic-shapes:8"), vlm, seq_len=48, global_batch=2))
    p = vlm.image_tokens
    assert (batch.tokens[:, :p] == 257).all() and not (batch.tokens == LLM.vocab_size - 1).any()
    model = build_vlm(vlm, seed=0)
    assert model.splice.image_token_id == 257
    model(batch.tokens, batch.images).sum().backward()
    assert float(model.llm.tok_embeddings.weight.grad[257].abs().sum()) == 0.0  # replaced by the images
    with pytest.raises(TesseraError, match="byte-level captions need ids 0..256 apart from the image token"):
        ImageTextLoader(load_image_text("synthetic-shapes:8"), VLM.model_copy(update=dict(image_token_id=10)),
                        seq_len=48, global_batch=2)


def test_image_files_and_bad_images(tmp_path):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "cat.npy", rng.integers(0, 255, (16, 16, 3), dtype=np.uint8))
    (tmp_path / "cat.txt").write_text("a cat")
    samples = load_image_text(tmp_path)
    assert [s.text for s in samples] == ["a cat"]
    loader = ImageTextLoader(samples, VLM, seq_len=24, global_batch=1)
    batch = next(loader)
    assert batch.images.shape == (1, 3, 16, 16) and float(batch.images.max()) <= 1.0
    lines = [{"image": "cat.npy", "text": "a cat"}, {"image": "synthetic-shapes:3", "text": ""}]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    assert len(load_image_text(tmp_path / "data.jsonl")) == 2
    np.save(tmp_path / "small.npy", np.zeros((8, 8, 3), dtype=np.float32))
    (tmp_path / "bad.jsonl").write_text(json.dumps({"image": "small.npy", "text": "x"}))
    bad = ImageTextLoader(load_image_text(tmp_path / "bad.jsonl"), VLM, seq_len=24, global_batch=1)
    with pytest.raises(TesseraError, match=r"small.npy is 8x8 with 3 channels; the encoder takes 16x16 with 3 channels"):
        next(bad)
    (tmp_path / "broken.jsonl").write_text('{"image": 3}')
    with pytest.raises(TesseraError, match=r"broken.jsonl:1 needs string fields 'image' and 'text'"):
        load_image_text(tmp_path / "broken.jsonl")
    with pytest.raises(TesseraError, match="must be a positive integer"):
        load_image_text("synthetic-shapes:x")


def test_train_cli_trains_a_vlm_from_its_config_json(tmp_path):
    """`tessera train --model <llava config.json> --data <image-text data>` end to end, one rank."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")

    def train(*args):
        return subprocess.run([sys.executable, "-m", "tessera", "train", "--model", str(root / "examples/tiny-llava"),
                               "--cluster", "builtin", "--out", str(tmp_path / "runs/{id}"), *args], env=env,
                              capture_output=True, text=True, timeout=600)

    proc = train("--data", "synthetic-shapes:256", "--steps", "8", "--lr", "3e-3", "--no-final-checkpoint")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(x) for x in next((tmp_path / "runs").glob("*/metrics.jsonl")).read_text().splitlines()]
    losses = [x["loss"] for x in lines if "loss" in x]
    assert len(losses) == 8 and losses[-1] < losses[0] - 1.0, losses  # from ~5.7 nats per caption token
    np.save(tmp_path / "gray.npy", np.zeros((32, 32), dtype=np.float32))
    (tmp_path / "gray.txt").write_text("grey")
    proc = train("--data", str(tmp_path), "--steps", "1", "--global-batch", "1")
    assert proc.returncode != 0
    assert "gray.npy is 32x32 with 1 channels; the encoder takes 32x32 with 3 channels" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_spindle_planner_waves_are_a_schedule_the_runtime_runs():
    """The planner's waves (`plan_spindle`) convert to the runtime's operators and pass its checks."""
    from pathlib import Path

    from tessera.adapt.spindle import plan_spindle
    from tessera.runtime.spindle import RunTask, check_waves, waves_of
    from tessera.search.multimodal import PartPricer
    from tessera.spec.multimodal import resolve_vlm
    from tessera.spec.presets.clusters import local_cpu_cluster
    from tessera.spec.tasks import parse_tasks

    vlm = resolve_vlm(str(Path(__file__).resolve().parents[1] / "examples/tiny-llava"))
    work = parse_tasks({"tasks": [
        dict(name="caption", modalities=["image", "text"], batch=8, images_per_sample=1, text_tokens=48),
        dict(name="text", modalities=["text"], batch=4, text_tokens=48)]})
    waves = waves_of(plan_spindle(PartPricer(vlm, local_cpu_cluster(4), dtype="fp32"), work, 4))
    tasks = {"caption": RunTask("caption", 8, 64), "text": RunTask("text", 4, 48, images=False)}
    check_waves(waves, tasks, 4)
    ops = [(op.task, op.part) for wave in waves for op in wave]
    assert sorted(ops) == [("caption", "llm"), ("caption", "vision_encoder"), ("text", "llm")]
    with pytest.raises(TesseraError, match="caption/llm runs before its task.s vision encoder"):
        check_waves([[op for op in wave if op.part != "vision_encoder"] for wave in waves if
                     any(op.part != "vision_encoder" for op in wave)], tasks, 4)


def test_train_takes_the_encoder_strategy_from_the_planner():
    """`tessera train` of a VLM: the planner's colocated plan when it is the choice; otherwise the best
    colocated plan the runtime runs, said in one line (both with the encoder and LLM plans)."""
    from tessera.cli.train_vlm import plan_vlm
    from tessera.spec.model import ModelSpec
    from tessera.spec.presets.clusters import local_cpu_cluster
    from tessera.spec.workload import Workload

    config = VLM_CONFIGS["tiny-vlm"]
    llm = ModelSpec.from_config(config.llm)
    got = plan_vlm(config, llm, 2, Workload(global_batch=16, seq_len=64, dtype="fp32"), local_cpu_cluster(2))
    assert got.plan.pipeline.degree == 1 and got.plan.model.config == config.llm and got.encoder["dp"] == 2
    assert got.lines[0].startswith("encoder plan") and got.lines[1].startswith("LLM plan")
    assert got.lines[2].startswith("chosen: no pipeline (colocated)")


def test_train_runs_the_planned_optimus_plan(monkeypatch):
    """A planned Optimus choice whose encoder plan the runtime runs is run as planned: the LLM
    pipeline plan, the encoder replicated with its passes where the planner placed them; one whose
    encoder plan it does not run falls back to the fastest plan it runs, said in one line."""
    import tessera.adapt.vlm_choice as vlm_choice
    from tessera.cli.train_vlm import _runnable_optimus, encoder_strategy, plan_vlm
    from tessera.search.space import SearchOptions
    from tessera.spec.model import ModelSpec
    from tessera.spec.multimodal import VLMSpec
    from tessera.spec.presets.clusters import local_cpu_cluster
    from tessera.spec.tasks import TaskSpec
    from tessera.spec.workload import Workload

    config = VLM_CONFIGS["tiny-vlm"]
    llm = ModelSpec.from_config(config.llm)
    cluster, workload = local_cpu_cluster(4), Workload(global_batch=16, seq_len=64, dtype="fp32")
    task = TaskSpec(name="image-text", modalities=("image", "text"), batch=16, images_per_sample=1,
                    text_tokens=64 - config.image_tokens)
    runnable = _runnable_optimus(VLMSpec.from_config(config), cluster, SearchOptions(),
                                 "fp32", task, 4)
    assert runnable is not None and runnable.pp > 1
    real = vlm_choice.choose

    def optimus_first(result):
        def choose(*args, **kwargs):
            c = real(*args, **kwargs)
            kinds = [vlm_choice.PlanKind("Optimus", result.step_s, result.tail_s, "", result)]
            return vlm_choice.Choice(tuple(kinds + [k for k in c.kinds if k.kind != "Optimus"]), c.skipped)
        return choose

    monkeypatch.setattr(vlm_choice, "choose", optimus_first(runnable))
    got = plan_vlm(config, llm, 4, workload, cluster)
    assert got.plan is runnable.llm_plan and got.plan.pipeline.degree == runnable.pp
    strategy = encoder_strategy(got.encoder)
    assert strategy.bubbles == runnable.counts and strategy.dp == 4
    assert strategy.zero == max(s.zero for s in runnable.encoder.plan.layers)  # ZeRO-sharded encoders run too
    assert got.lines[-1].startswith("chosen: Optimus")
    # An Optimus plan whose encoder is tensor parallel: the fastest plan the runtime runs instead.
    from dataclasses import replace
    tp2 = replace(runnable, encoder_by_rank=(), encoder=replace(runnable.encoder, plan=runnable.encoder.plan.model_copy(
        update={"layers": tuple(s.model_copy(update={"tp": 2}) for s in runnable.encoder.plan.layers)})))
    monkeypatch.setattr(vlm_choice, "choose", optimus_first(tp2))
    got = plan_vlm(config, llm, 4, workload, cluster)
    assert "is not run by this runtime yet (the Optimus encoder plan uses tensor/sequence parallelism or offload" \
        in got.lines[-1] and "running the fastest plan it runs" in got.lines[-1]
    # One ZeRO stage for the whole encoder, or a one-line refusal.
    from tessera.errors import TesseraError
    from tessera.runtime.multimodal import from_optimus
    layers = runnable.encoder.plan.layers
    mixed = replace(runnable, encoder_by_rank=(), encoder=replace(runnable.encoder, plan=runnable.encoder.plan.model_copy(
        update={"layers": (layers[0].model_copy(update={"zero": 1}),) + tuple(
            s.model_copy(update={"zero": 3}) for s in layers[1:])})))
    with pytest.raises(TesseraError, match=r"^the Optimus encoder plan mixes ZeRO stages \[1, 3\], which this "
                                           r"runtime does not run in the bubbles \(one stage for the whole encoder\)$"):
        from_optimus(mixed, 4)


def test_the_optimus_runtime_refuses_what_it_cannot_run_in_one_line():
    """Bubble counts of the wrong shape or sum, a multi-chunk LLM schedule and a non-replicated
    encoder are each refused in one sentence naming the value."""
    from tessera.runtime.multimodal import EncoderStrategy, _check_pipeline
    from tessera.runtime.vlm_pipeline import check_counts
    from tessera.search import manual_plan
    from tessera.spec import Workload
    from tessera.spec.presets import get_model, make_cluster

    check_counts([[1, 1], [1, 1]], pp=2, m=2, images_per_micro_batch=2)  # a valid placement
    with pytest.raises(TesseraError, match=r"^encoder bubbles must give 2 pipeline ranks x 2 micro-batches of image "
                                           r"counts, not 1 x 2$"):
        check_counts([[1, 1]], pp=2, m=2, images_per_micro_batch=2)
    with pytest.raises(TesseraError, match=r"^encoder bubbles: micro-batch 1 has 2 images, the counts place 3$"):
        check_counts([[1, 2], [1, 1]], pp=2, m=2, images_per_micro_batch=2)

    def pipeline(**kw):
        return manual_plan(get_model("tiny-llama"), make_cluster("h100-80gb", 4), Workload(global_batch=8, seq_len=64),
                           pp=2, dp=2, **kw)

    _check_pipeline(pipeline(), EncoderStrategy())
    with pytest.raises(TesseraError, match=r"one chunk per rank, not interleaved_1f1b with 2$"):
        _check_pipeline(pipeline(schedule="interleaved_1f1b", virtual_stages=2), EncoderStrategy())
    _check_pipeline(pipeline(), EncoderStrategy(zero=3))  # sharded over each stage, replicated across stages
    with pytest.raises(TesseraError, match=r"encoder runs on every rank \(encoder dp = all\), not dp=2 from rank 0$"):
        _check_pipeline(pipeline(), EncoderStrategy(dp=2, zero=1))
    # Blocks recomputed per pipeline rank: one entry per rank, naming blocks the encoder runs.
    EncoderStrategy(recompute_blocks=((1,), ())).check_recompute(pipeline_ranks=2, blocks=2)
    assert EncoderStrategy(recompute_blocks=((1,), ())).recomputed(0, 2) == (1,)
    assert EncoderStrategy(recompute=True).recomputed(1, 3) == (0, 1, 2)
    with pytest.raises(TesseraError, match=r"^encoder recompute_blocks has 1 entries for 2 pipeline ranks$"):
        EncoderStrategy(recompute_blocks=((1,),)).check_recompute(pipeline_ranks=2, blocks=2)
    with pytest.raises(TesseraError, match=r"^encoder recompute_blocks names blocks \[2\]; the encoder runs blocks "
                                           r"0\.\.1$"):
        EncoderStrategy(recompute_blocks=((2,), ())).check_recompute(pipeline_ranks=2, blocks=2)
