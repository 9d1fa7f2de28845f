"""A vision-language model with separate encoder and LLM plans against one process (fp32).

For each (LLM plan, encoder strategy) at 4 ranks: every parameter's gradient after the first step
(encoder, projector and LLM; 1e-5 relative) against a one-process `VisionLanguageModel` on the
same global batch of synthetic-shape images and captions; then `train()` for 3 steps (the
trainer's data loader, global-norm clipping over both parts, AdamW) against the one-process
losses. Then a multi-task step in Spindle waves (three tasks, two waves, each task's LLM on other
ranks than its encoder): gradients on every rank and two trained steps against one process running
the tasks one after another, and malformed schedules refused in one sentence.
Rank 0 prints `CHECK <name> ok` per check.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from runtime_common import LLAMA, OPTIM, S, make_plan, train_one_process  # noqa: E402

from tessera.models.vision import build_vlm  # noqa: E402
from tessera.runtime.image_data import ImageTextLoader, load_image_text  # noqa: E402
from tessera.runtime.materialize import full_value_slice  # noqa: E402
from tessera.runtime.multimodal import EncoderStrategy, MultimodalTrainer  # noqa: E402
from tessera.runtime.optim import OptimConfig, build_optimizer, build_scheduler, clip_grad_norm_  # noqa: E402
from tessera.runtime.trainer import TrainConfig  # noqa: E402
from tessera.spec.multimodal import ProjectorConfig, VisionEncoderConfig, VLMConfig  # noqa: E402

WORLD = int(os.environ["WORLD_SIZE"])
BATCH, SEQ, STEPS = 8, 64, 3
DATA = "synthetic-shapes:64"

CLIP_LIKE = VLMConfig(
    name="test-vlm", vision=VisionEncoderConfig(name="test-vit", image_size=16, patch_size=4, hidden=32, num_layers=3,
                                                num_heads=4, ffn_hidden=64, act="quick_gelu"),
    feature_layer=-2, projector=ProjectorConfig(layers=2), llm=LLAMA)
QWEN_LIKE = VLMConfig(
    name="test-qwen2-vl", family="qwen2_vl",
    vision=VisionEncoderConfig(name="test-qvit", family="qwen2_vl", image_size=16, patch_size=2, temporal_patch_size=2,
                               hidden=32, num_layers=2, num_heads=4, ffn_hidden=64, position="rope2d",
                               class_token=False),
    projector=ProjectorConfig(merge=2, norm=True, layers=2, hidden=64), llm=LLAMA)


def global_batch(vlm, step: int = 0):
    loader = ImageTextLoader(load_image_text(DATA), vlm, SEQ, BATCH)
    return loader.batch_at(step * BATCH)


def reference_gradients(vlm):
    model = build_vlm(vlm, seed=0)
    b = global_batch(vlm)
    logits = model(b.tokens, b.images)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), b.labels.flatten(), ignore_index=-100)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def reference_losses(vlm, steps: int):
    optim = OptimConfig(**{**OPTIM.__dict__, "total_steps": steps})
    loader = ImageTextLoader(load_image_text(DATA), vlm, SEQ, BATCH)
    batches = [(b.tokens, b.labels, b.images) for b in (next(loader) for _ in range(steps))]
    return train_one_process(build_vlm(vlm, seed=0), optim, batches)


_GRADS: dict = {}


def check_gradients(name: str, plan, vlm, encoder: EncoderStrategy, rtol: float = 1e-5) -> None:
    if vlm.name not in _GRADS:
        _GRADS[vlm.name] = reference_gradients(vlm)
    want_all = _GRADS[vlm.name]
    trainer = MultimodalTrainer(TrainConfig(plan=plan, steps=1, optim=OPTIM, seed=0), vlm, encoder)
    if encoder.recompute_blocks:  # this rank's replica recomputes the blocks asked of its pipeline rank
        blocks = list(trainer.encoder.vision.layers.values())
        pp_rank = trainer.dims.pp_rank(trainer.rank) if plan.pipeline.degree > 1 else 0
        wrapped = tuple(i for i, blk in enumerate(blocks) if hasattr(blk, "_checkpoint_wrapped_module"))
        assert wrapped == encoder.recomputed(pp_rank, len(blocks)), (name, wrapped)
    b = global_batch(vlm)
    rows = trainer.encoded_rows()
    images = b.images[rows] if rows else b.images[:0]
    trainer.compute_gradients(trainer.local_rows(b.tokens), trainer.local_rows(b.labels), images, b.num_targets)
    floor = 1e-3 * max(float(g.abs().max()) for g in want_all.values())
    seen, worst = set(), torch.zeros(())
    for n, p in trainer.named_parameters():
        if p.grad is None:
            raise AssertionError(f"{name}: {n} has no gradient")
        want = full_value_slice(want_all[n], p.grad)
        got = (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).detach()
        err = float((got - want).abs().max()) if want.numel() else 0.0
        scale = max(float(want_all[n].abs().max()), floor)
        if err > rtol * scale:
            raise AssertionError(f"{name}: gradient of {n} off by {err:.3e} (max |grad| {scale:.3e})")
        worst = torch.maximum(worst, torch.tensor(err / scale))
        seen.add(n)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f"GRADIENT {name} max relative error {float(worst):.2e}", flush=True)
    # Every parameter of the model has its gradient checked on some rank.
    names = [None] * WORLD
    dist.all_gather_object(names, sorted(seen))
    missing = set(want_all) - set().union(*map(set, names))
    if missing:
        raise AssertionError(f"{name}: no rank holds {sorted(missing)[:3]}")
    trainer.close()
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def check_training(name: str, plan, vlm, encoder: EncoderStrategy, rtol: float = 5e-5) -> None:
    trainer = MultimodalTrainer(TrainConfig(plan=plan, steps=STEPS, optim=OPTIM, seed=0, data=DATA), vlm, encoder)
    records = trainer.train()
    trainer.close()
    want = reference_losses(vlm, STEPS)
    for r in records:
        w = want[r.step - 1]
        if abs(r.loss - w) > rtol * abs(w):
            raise AssertionError(f"{name}: step {r.step} loss {r.loss:.8f} != one-process {w:.8f}")
    assert len(records) == STEPS, len(records)
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def plan(strategies, micro: int = 1, stages=None):
    return make_plan(LLAMA, WORLD, strategies, num_micro_batches=micro, global_batch=BATCH, seq_len=SEQ,
                     stages=stages)


PP2, PP4 = ((0, 3), (3, 6)), ((0, 2), (2, 3), (3, 4), (4, 6))


n = len(plan(S(dp=WORLD)).layers)
tp_ends = [S(tp=4)] + [S(dp=2, tp=2, sp="megatron")] * (n - 2) + [S(tp=4, sp="megatron")]
layerwise = [S(dp=4)] + [S(dp=2, tp=2, sp="megatron", zero=3)] * 2 + [S(dp=4, zero=2)] * (n - 4) + [S(tp=4)]
CASES = [
    ("vlm_llm_dp4_ddp_encoder_dp4", plan(S(dp=4)), CLIP_LIKE, EncoderStrategy()),
    ("vlm_llm_dp2_tp2_encoder_ranks01", plan(S(dp=2, tp=2)), CLIP_LIKE, EncoderStrategy(dp=2)),
    ("vlm_llm_vocab_tp4_blocks_dp2_tp2_sp_mb2_encoder_zero3_ranks23_recompute",
     plan(tp_ends, micro=2), CLIP_LIKE, EncoderStrategy(dp=2, first_rank=2, zero=3, recompute=True)),
    ("vlm_llm_layerwise_mb2_encoder_zero2_dp4", plan(layerwise, micro=2), CLIP_LIKE, EncoderStrategy(zero=2)),
    ("vlm_qwen2vl_llm_ulysses2_dp2_encoder_rank1", plan(S(dp=2, sp="ulysses", sp_degree=2)), QWEN_LIKE,
     EncoderStrategy(dp=1, first_rank=1)),
    # Optimus: an LLM pipeline, the encoder's passes in its warm-up / cool-down bubbles (vlm_pipeline.py).
    ("vlm_optimus_pp2_dp2_mb4_planned_bubbles", plan(S(dp=2), micro=4, stages=PP2), CLIP_LIKE, EncoderStrategy()),
    ("vlm_optimus_pp4_mb4_recompute_given_bubbles", plan(S(recompute="full"), micro=4, stages=PP4), CLIP_LIKE,
     EncoderStrategy(recompute=True, bubbles=((1, 0, 0, 1), (0, 1, 0, 1), (1, 0, 1, 0), (0, 1, 1, 0)))),
    ("vlm_optimus_pp2_tp2_gpipe_mb2_stage0_encodes_nothing",
     make_plan(LLAMA, WORLD, S(tp=2), num_micro_batches=2, global_batch=BATCH, seq_len=SEQ, stages=PP2,
               schedule="gpipe"), CLIP_LIKE, EncoderStrategy(bubbles=((0, 0), (4, 4)))),
    # A sharded encoder (FSDP2 over each stage's 2 ranks, replicated across the 2 stages): a pass
    # of one image leaves a stage rank an empty batch, which still gathers and reduces.
    ("vlm_optimus_pp2_dp2_mb4_encoder_zero3_hsdp_empty_shares", plan(S(dp=2), micro=4, stages=PP2), CLIP_LIKE,
     EncoderStrategy(zero=3, bubbles=((1, 2, 0, 1), (1, 0, 2, 1)))),
    # Each pipeline rank's replica recomputes its own blocks (the planner recomputes fewer where a
    # rank's memory holds more): the same gradients.
    ("vlm_optimus_pp2_dp2_mb4_encoder_zero2_recompute_per_rank", plan(S(dp=2), micro=4, stages=PP2), CLIP_LIKE,
     EncoderStrategy(zero=2, recompute=True, bubbles=((2, 1, 1, 0), (0, 1, 1, 2)), recompute_blocks=((1,), ()))),
]

def planned_case():
    """The planner's separate plans for a captioning task (encoder and LLM each their own), as run."""
    from tessera.runtime.multimodal import from_task_plan
    from tessera.search.multimodal import PartPricer, plan_vlm_task
    from tessera.spec.multimodal import VLMSpec
    from tessera.spec.presets.clusters import local_cpu_cluster
    from tessera.spec.tasks import TaskSpec

    task = TaskSpec(name="caption", modalities=("image", "text"), batch=BATCH,
                    text_tokens=SEQ - CLIP_LIKE.image_tokens, images_per_sample=1)
    pricer = PartPricer(VLMSpec.from_config(CLIP_LIKE), local_cpu_cluster(WORLD), dtype="fp32")
    llm_plan, encoder = from_task_plan(plan_vlm_task(pricer, task, WORLD, encoder_gpus=WORLD), WORLD)
    return ("vlm_planned_task_colocated", llm_plan, CLIP_LIKE, encoder)


def planned_optimus_case():
    """The planner's Optimus plan for the same task (an LLM pipeline, the encoder's passes where it
    placed them, its encoder plan data parallel, with or without ZeRO: what `tessera train` runs)."""
    from tessera.cli.train_vlm import _runnable_optimus
    from tessera.runtime.multimodal import from_optimus
    from tessera.search.space import SearchOptions
    from tessera.spec.multimodal import VLMSpec
    from tessera.spec.presets.clusters import local_cpu_cluster
    from tessera.spec.tasks import TaskSpec

    task = TaskSpec(name="caption", modalities=("image", "text"), batch=BATCH,
                    text_tokens=SEQ - CLIP_LIKE.image_tokens, images_per_sample=1)
    result = _runnable_optimus(VLMSpec.from_config(CLIP_LIKE), local_cpu_cluster(WORLD),
                               SearchOptions(), "fp32", task, WORLD)
    llm_plan, encoder = from_optimus(result, WORLD)
    assert llm_plan.pipeline.degree > 1 and encoder.bubbles == result.counts
    return ("vlm_optimus_planned_pipeline_and_bubbles", llm_plan, CLIP_LIKE, encoder)


for case in CASES + [planned_case(), planned_optimus_case()]:
    check_gradients(*case)
check_training("vlm_train_3_steps_llm_dp2_tp2_zero3_encoder_ranks01", plan(S(dp=2, tp=2, zero=3)), CLIP_LIKE,
               EncoderStrategy(dp=2))
check_training("vlm_optimus_train_3_steps_pp2_dp2_zero1", plan(S(dp=2, zero=1), micro=4, stages=PP2), CLIP_LIKE,
               EncoderStrategy())
check_training("vlm_optimus_train_3_steps_pp2_dp2_encoder_zero1_hsdp", plan(S(dp=2), micro=4, stages=PP2), CLIP_LIKE,
               EncoderStrategy(zero=1))


# --- Spindle: several tasks in waves on groups of ranks, the shared model's gradients combined ----
from tessera.errors import TesseraError  # noqa: E402
from tessera.runtime.spindle import RunOp, RunTask, SpindleSteps, one_process_gradients  # noqa: E402

TASKS = [RunTask("caption", batch=8, seq_len=64), RunTask("text", batch=4, seq_len=48, images=False, seed=1),
         RunTask("short_caption", batch=4, seq_len=32, seed=2)]
WAVES = [[RunOp("caption", "vision_encoder", 0, 2), RunOp("short_caption", "vision_encoder", 2, 1),
          RunOp("text", "llm", 3, 1)],
         # each task's LLM on other ranks than its encoder: the image tokens cross groups
         [RunOp("caption", "llm", 2, 2), RunOp("short_caption", "llm", 0, 2)]]


def check_spindle(name: str, vlm, rtol: float = 1e-5) -> None:
    steps = SpindleSteps(vlm, TASKS, WAVES, optim=OPTIM, seed=0)
    steps.compute_gradients()
    ref = build_vlm(vlm, seed=0)
    one_process_gradients(ref, vlm, TASKS)
    want = dict(ref.named_parameters())
    floor = 1e-3 * max(float(p.grad.abs().max()) for p in want.values())
    for n, p in steps.model.named_parameters():
        err = float((p.grad - want[n].grad).abs().max())
        if err > rtol * max(float(want[n].grad.abs().max()), floor):
            raise AssertionError(f"{name}: gradient of {n} off by {err:.3e}")
    steps.optimizer.zero_grad(set_to_none=True)
    # Two optimizer steps against one process doing the same.
    got = [steps.train_step() for _ in range(2)]
    opt = build_optimizer(ref.parameters(), OPTIM)
    sched = build_scheduler(opt, OPTIM)
    ref.zero_grad(set_to_none=True)
    for k, g in enumerate(got):
        w = float(one_process_gradients(ref, vlm, TASKS, step=k))
        clip_grad_norm_(list(ref.parameters()), OPTIM.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if abs(g - w) > 5e-5 * abs(w):
            raise AssertionError(f"{name}: step {k} loss {g:.8f} != one process {w:.8f}")
    # A schedule that cannot run is refused in one sentence.
    for waves, match in [([[RunOp("caption", "llm", 0, 4)]], "runs before its task's vision encoder"),
                         ([[RunOp("caption", "vision_encoder", 0, 2), RunOp("text", "llm", 1, 2)]],
                          "shares ranks with another operator"),
                         ([[RunOp("nope", "llm", 0, 1)]], "names an unknown task")]:
        try:
            SpindleSteps(vlm, TASKS, waves, optim=OPTIM)
        except TesseraError as e:
            assert match in str(e), str(e)
        else:
            raise AssertionError(f"{name}: the schedule {waves} was not refused")
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)


check_spindle("spindle_3_tasks_2_waves_cross_group_handoff", CLIP_LIKE)
