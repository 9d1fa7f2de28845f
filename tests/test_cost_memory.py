"""Memory formulas against hand-computed figures."""
import numpy as np
import pytest

from tessera.cost.layer import StepContext, StrategyTable, layer_costs
from tessera.cost.memory import RC_FULL, RC_NONE, RC_SELECTIVE, activation_bytes, buffer_bytes, model_state_bytes
from tessera.plan import LayerStrategy
from tessera.search import manual_plan
from tessera.spec import ModelSpec, TransformerConfig, Workload
from tessera.spec.presets import get_model, make_cluster

GB = 1e9


def test_llama2_7b_bf16_weights_are_13_5_gb():
    m = get_model("llama2-7b")
    plan = manual_plan(m, make_cluster("h100-80gb", 8), Workload(global_batch=8, seq_len=4096), recompute="full")
    mem = plan.prediction.stage_memory[0]
    assert m.num_params == pytest.approx(6.74e9, rel=1e-3)
    assert mem.params / GB == pytest.approx(13.48, abs=0.01)
    assert mem.grads == pytest.approx(2 * mem.params)  # fp32 gradients (the runtime's)
    megatron_fp16 = Workload(global_batch=8, seq_len=4096, dtype="fp16", grad_dtype="fp16")
    plan = manual_plan(m, make_cluster("h100-80gb", 8), megatron_fp16, recompute="full")
    assert plan.prediction.stage_memory[0].grads == pytest.approx(mem.params)  # gradients in fp16
    assert mem.optimizer == pytest.approx(12 * m.num_params)  # fp32 master + Adam m, v


def test_zero3_over_64_gpus_divides_model_states_by_64():
    m = get_model("llama2-7b")
    cluster, wl = make_cluster("h100-80gb", 64), Workload(global_batch=64, seq_len=4096)
    plain = manual_plan(m, cluster, wl, zero=0).prediction.stage_memory[0]
    z3 = manual_plan(m, cluster, wl, zero=3).prediction.stage_memory[0]
    for field in ("grads", "optimizer"):
        assert getattr(z3, field) * 64 == pytest.approx(getattr(plain, field), rel=1e-12)
    # The bf16 working copy exists only while gathered (a buffer): the fp32 shard is the master.
    assert z3.params == 0 and plain.params == pytest.approx(2 * m.num_params)


def test_zero_stages_shard_optimizer_then_grads_then_params():
    layer = get_model("llama2-7b").layers[1]
    wl = Workload(global_batch=8, seq_len=4096)
    p, g, o = model_state_bytes(layer, wl, tp=np.array([1] * 4), ep=np.array([1] * 4), zero=np.arange(4),
                                shard=np.array([1, 8, 8, 8]), expert_shard_deg=np.array([1, 8, 8, 8]),
                                offload=np.zeros(4, bool))
    n = layer.params
    assert list(p) == pytest.approx([2 * n, 2 * n, 2 * n, 0])  # ZeRO-3: the fp32 shard is the master
    assert list(g) == pytest.approx([4 * n, 4 * n, 4 * n / 8, 4 * n / 8])  # fp32
    assert list(o) == pytest.approx([12 * n, 12 * n / 8, 12 * n / 8, 12 * n / 8])
    _, g32, o32 = model_state_bytes(layer, Workload(global_batch=8, seq_len=4096, dtype="fp32"), 1, 1, 0, 1, 1, False)
    assert g32 == pytest.approx(4 * n) and o32 == pytest.approx(8 * n)  # fp32 grads; Adam m, v only
    *_, off = model_state_bytes(layer, wl, 1, 1, 1, 8, 8, True)
    assert off == 0.0


def _gpt_block(h=1024, heads=16):
    """A GPT block as Megatron-LM runs it (fused kernels: Korthikanti et al.'s accounting)."""
    cfg = TransformerConfig(name="gpt-test", family="gpt2", vocab_size=1000, hidden=h, num_layers=1,
                            num_heads=heads, num_kv_heads=heads, ffn_hidden=4 * h, norm="layernorm",
                            mlp="gelu", position="learned", linear_bias=True)
    return ModelSpec.from_config(cfg, kernels="fused").layers[1]


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_gpt_block_activations_follow_korthikanti(t):
    """s b h (34 + 5 a s / h) per layer, minus the two 1-byte dropout masks (2 s b h), minus the
    attention-score term (flash attention): 32 s b h; with TP s b h (8 + 24/t); with TP + SP 32 s b h / t."""
    layer, s, b = _gpt_block(), 2048, 4
    h = layer.hidden
    sbh = s * b * h
    tokens = s * b
    assert activation_bytes(layer, tokens, 1, False, RC_NONE) == pytest.approx(32 * sbh)
    assert activation_bytes(layer, tokens, t, False, RC_NONE) == pytest.approx(sbh * (8 + 24 / t))
    assert activation_bytes(layer, tokens, t, t > 1, RC_NONE) == pytest.approx(32 * sbh / t)
    # Full recompute keeps only the block input (2 s b h in bf16), sharded by SP.
    assert activation_bytes(layer, tokens, t, t > 1, RC_FULL) == pytest.approx(2 * sbh / t)
    # Selective drops the attention output and the GeLU output.
    assert activation_bytes(layer, tokens, 1, False, RC_SELECTIVE) == pytest.approx(32 * sbh - 2 * sbh - 8 * sbh)


def test_ulysses_shards_activations_by_the_sequence_degree():
    layer = get_model("llama2-7b").layers[1]
    ctx = StepContext(cluster=make_cluster("h100-80gb", 8), workload=Workload(global_batch=8, seq_len=4096),
                      stage_size=8, micro_batch_seqs=8)
    table = StrategyTable.build([LayerStrategy(dp=8), LayerStrategy(dp=2, sp="ulysses", sp_degree=4)])
    act = layer_costs(layer, table, ctx).act
    # dp=2 runs 4 sequences per replica, split 4 ways along the sequence: 1 sequence's worth each,
    # plus the all-to-all's copy of the attention output the output projection saves (2 x 4096).
    assert act[1] == pytest.approx(act[0] + 4096 * 2 * 4096)


def test_in_flight_activations_scale_the_stage_memory():
    m = get_model("llama2-7b")
    cluster, wl = make_cluster("h100-80gb", 8), Workload(global_batch=64, seq_len=2048)
    gpipe = manual_plan(m, cluster, wl, pp=4, tp=2, sp="megatron", schedule="gpipe").prediction
    one = manual_plan(m, cluster, wl, pp=4, tp=2, sp="megatron", schedule="1f1b").prediction
    m_count = 64  # dp = 8 / (pp 4 x tp 2) = 1, micro-batch 1
    # Rank 1 holds all m micro-batches under GPipe and pp - 1 = 3 under 1F1B.
    assert gpipe.stage_memory[1].activations / one.stage_memory[1].activations == pytest.approx(m_count / 3)


def test_expert_parallelism_divides_expert_states_only():
    layer = get_model("mixtral-8x7b").layers[1]
    wl = Workload(global_batch=8, seq_len=4096)
    p1, _, _ = model_state_bytes(layer, wl, 1, 1, 0, 1, 1, False)
    p8, _, _ = model_state_bytes(layer, wl, 1, 8, 0, 1, 1, False)
    assert p1 == pytest.approx(2 * layer.params)
    assert p8 == pytest.approx(2 * (layer.dense_params + layer.expert_params / 8))


def test_fragmentation_and_margin_are_explicit():
    from tessera.cost.memory import memory_budget, required_memory

    c = make_cluster("h100-80gb", 8)
    plan = manual_plan(get_model("llama2-7b"), c, Workload(global_batch=8, seq_len=4096), zero=3)
    mem = plan.prediction.stage_memory[0]
    allocated = mem.params + mem.grads + mem.optimizer + mem.activations + mem.buffers - c.device.reserved_bytes
    assert mem.fragmentation == pytest.approx(0.10 * allocated)
    assert mem.total == pytest.approx(required_memory(allocated, c)) == pytest.approx(1.1 * allocated + 2 * 2**30)
    # The planner's budget for allocated bytes: (80 GiB x 0.95 - 2 GiB) / 1.1.
    assert memory_budget(c) == pytest.approx((80 * 2**30 * 0.95 - 2 * 2**30) / 1.1)
    tight = c.model_copy(update={"device": c.device.model_copy(update={"memory_bytes": mem.total / 0.96})})
    wl = Workload(global_batch=8, seq_len=4096)
    assert not manual_plan(get_model("llama2-7b"), tight, wl, zero=3).prediction.fits
    free = tight.model_copy(update={"memory_margin": 0.0})
    assert manual_plan(get_model("llama2-7b"), free, wl, zero=3).prediction.fits


def test_searched_plans_keep_the_margin():
    from tessera.search import search

    for gpus, batch in ((8, 64), (64, 512)):
        c = make_cluster("h100-80gb", gpus)
        plan = search(get_model("llama2-7b"), c, Workload(global_batch=batch, seq_len=4096))
        assert plan.prediction.peak_memory <= 0.95 * c.device.memory_bytes


def test_tied_embeddings_are_counted_once_per_rank_that_holds_them():
    m = get_model("gpt2")
    head = m.layers[-1]
    assert head.tied_params == 50257 * 768 and head.params == head.tied_params + 2 * 768
    assert m.num_params == 124_439_808
    wl = Workload(global_batch=8, seq_len=1024)
    one = manual_plan(m, make_cluster("h100-80gb", 1), wl).prediction.stage_memory
    assert one[0].params == pytest.approx(2 * m.num_params)  # pp = 1: the shared weight once
    two = manual_plan(m, make_cluster("h100-80gb", 2), wl, pp=2).prediction.stage_memory
    assert two[0].params + two[1].params == pytest.approx(2 * (m.num_params + head.tied_params))  # a copy


def test_offload_keeps_shards_on_the_host():
    layer = get_model("llama2-7b").layers[1]
    wl = Workload(global_batch=8, seq_len=4096)
    n, S = layer.params, 8
    p, g, o = model_state_bytes(layer, wl, tp=np.array([1] * 3), ep=np.array([1] * 3), zero=np.array([1, 2, 3]),
                                shard=np.array([S] * 3), expert_shard_deg=np.array([S] * 3),
                                offload=np.ones(3, bool))
    # Unsharded copies only: parameters below ZeRO-3, gradients below ZeRO-2; no optimizer state.
    assert list(p) == pytest.approx([2 * n, 2 * n, 0.0])
    assert list(g) == pytest.approx([4 * n, 0.0, 0.0])  # fp32
    assert list(o) == pytest.approx([0.0, 0.0, 0.0])
    c = make_cluster("h100-80gb", 8)
    ctx = StepContext(cluster=c, workload=wl, stage_size=8, micro_batch_seqs=8)
    t = StrategyTable.build([LayerStrategy(dp=8, zero=3), LayerStrategy(dp=8, zero=3, offload_optimizer=True)])
    costs = layer_costs(layer, t, ctx)
    # The fp32 gradient shard and the optimizer state (fp32 master, m, v) on the host.
    assert costs.host[0] == 0 and costs.host[1] == pytest.approx((4 + 12) * n / S)
    # The AdamW step on the host: the fp32 states read and written, the fp32 gradient read,
    # 2 x 12 + 4 bytes per local parameter at host DRAM bandwidth.
    assert costs.optimizer_time[1] == pytest.approx(28 * n / S / c.host_memory_bandwidth)
    # H2D before each all-gather (2 per micro-batch), D2H after the reduce-scatter: on the backward.
    assert costs.bwd[1] > costs.bwd[0]


def test_offload_beyond_host_memory_does_not_fit():
    from tessera.search import NoFeasiblePlanError, search

    wl = Workload(global_batch=8, seq_len=4096)
    plan = manual_plan(get_model("llama3-405b"), make_cluster("h100-80gb", 8), wl, zero=3, offload=True,
                       recompute="full")
    mem = plan.prediction.stage_memory[0]
    assert mem.params == 0 and mem.host == pytest.approx(16 * get_model("llama3-405b").num_params / 8, rel=1e-3)
    assert not plan.prediction.fits  # 810 GB per GPU against 256 GiB of host memory
    with pytest.raises(NoFeasiblePlanError):
        search(get_model("llama3-405b"), make_cluster("h100-80gb", 8), wl)


# --- the runtime's eager modules: per-operation counts ------------------------------------------

TINY = TransformerConfig(name="mem-llama", hidden=256, num_layers=4, num_heads=8, num_kv_heads=4,
                         ffn_hidden=688, vocab_size=4096, max_seq_len=512)


def test_eager_llama_block_counts_what_autograd_saves():
    """Per token, a = 2 (bf16), r = 4: two norms keep input and output (a 4h) and rstd (2r); SDPA
    q, k, v, output (a (2q + 2kv)) and logsumexp (r heads); SwiGLU w1, w3, SiLU, product (a 4f)."""
    layer = ModelSpec.from_config(TINY).layers[1]
    h, q, kv, f, heads = 256, 256, 128, 688, 8
    assert layer.act_bytes_replicated == 2 * 4 * h
    assert layer.act_bytes_tp == 2 * (2 * q + 2 * kv + 4 * f)
    assert layer.act_fp32_replicated == 2 * 4 and layer.act_fp32_tp == 4 * heads
    per_token = 2 * (4 * h + 2 * q + 2 * kv + 4 * f) + 4 * (2 + heads)
    assert activation_bytes(layer, 1000, 1, False, RC_NONE) == pytest.approx(1000 * per_token)
    # fp32 on a CPU (composite RMSNorm): 4 (6h + 2q + 2kv + 4f + heads + 2), measured exactly
    # (test_allocator_peak_matches_the_prediction).
    cpu = activation_bytes(layer, 1000, 1, False, RC_NONE, elt=4, fused_norms=False)
    assert cpu == pytest.approx(1000 * 4 * (6 * h + 2 * q + 2 * kv + 4 * f + heads + 2))
    # Selective (the runtime's policy: matmul outputs and the block input kept): a (3h + q + 2kv + 2f).
    kept = 2 * (3 * h + q + 2 * kv + 2 * f)
    assert activation_bytes(layer, 1000, 1, False, RC_SELECTIVE) == pytest.approx(1000 * kept)
    assert activation_bytes(layer, 1000, 1, False, RC_FULL) == pytest.approx(1000 * 2 * h)
    # TP divides q, k, v, the MLP and the logsumexp; SP also the norms' tensors.
    assert activation_bytes(layer, 1000, 2, True, RC_NONE) == pytest.approx(1000 * per_token / 2)


def test_eager_gpt_block_counts_layernorm_and_gelu():
    cfg = TINY.model_copy(update=dict(family="gpt2", norm="layernorm", mlp="gelu", position="learned",
                                      num_kv_heads=8, linear_bias=True))
    layer = ModelSpec.from_config(cfg).layers[1]
    h, q, f, heads = 256, 256, 688, 8
    # LayerNorm keeps mean and rstd (2r); GeLU: fc1 and GeLU outputs (a 2f).
    assert activation_bytes(layer, 1, 1, False, RC_NONE) == pytest.approx(2 * (4 * h + 4 * q + 2 * f) + 4 * (4 + heads))
    assert layer.rms_norm_width == 0
    assert activation_bytes(layer, 1, 1, False, RC_SELECTIVE) == pytest.approx(2 * (3 * h + 3 * q + f))


def test_eager_lm_head_keeps_fp32_log_probabilities_and_the_logits():
    head = ModelSpec.from_config(TINY).layers[-1]
    h, v = 256, 4096
    # Norm (a 2h + r), log-softmax (r V), the loop's logits (a V); bf16:
    assert activation_bytes(head, 10, 1, False, RC_NONE) == pytest.approx(10 * (2 * 2 * h + 4 + 4 * v + 2 * v))
    # Vocabulary-parallel under TP.
    assert activation_bytes(head, 10, 4, False, RC_NONE) == pytest.approx(10 * (2 * 2 * h + 4 + (4 * v + 2 * v) / 4))
    # Transient at the start of backward: gradients of the log-probabilities and fp32 logits (2r V).
    wl = Workload(global_batch=1, seq_len=10)
    assert buffer_bytes(head, wl, 10, 1, 1, False, 0, RC_NONE) == pytest.approx(10 * 8 * v)


def test_block_backward_transient_is_the_gradient_and_mlp_branches():
    layer = ModelSpec.from_config(TINY).layers[1]
    wl = Workload(global_batch=1, seq_len=10)
    # a (h + 2f) bf16; full recompute adds the replayed activations.
    assert buffer_bytes(layer, wl, 10, 1, 1, False, 0, RC_NONE) == pytest.approx(10 * 2 * (256 + 2 * 688))
    full = buffer_bytes(layer, wl, 10, 1, 1, False, 0, RC_FULL)
    assert full == pytest.approx(10 * 2 * (256 + 2 * 688) + activation_bytes(layer, 10, 1, False, RC_NONE))


def test_cpu_composite_rmsnorm_keeps_fp32_upcasts():
    """rms_norm's composite (a CPU) keeps the fp32 upcast input, rsqrt and normalised product
    (8h + r) instead of the fused kernel's input and rstd (a h + r): (8 - a) h more per norm."""
    layer = ModelSpec.from_config(TINY).layers[1]
    fused = activation_bytes(layer, 1, 1, False, RC_NONE, elt=2)
    composite = activation_bytes(layer, 1, 1, False, RC_NONE, elt=2, fused_norms=False)
    assert composite - fused == pytest.approx(2 * (8 - 2) * 256)


def test_measured_activation_bytes_are_not_rescaled():
    layer = ModelSpec.from_config(TINY).layers[1].model_copy(update=dict(compute_measured=True))
    assert activation_bytes(layer, 1, 1, False, RC_NONE, elt=4, fused_norms=False) == pytest.approx(
        layer.act_bytes_tp + layer.act_bytes_replicated)


@pytest.mark.parametrize("extra", [dict(micro_batch_size=2), dict(micro_batch_size=2, recompute="full"),
                                   dict(micro_batch_size=2, recompute="selective"), dict(micro_batch_size=1)])
def test_allocator_peak_matches_the_prediction(extra):
    """One process, no torchrun: the runtime's trainer steps a tiny LLaMA on the CPU; the torch
    allocator's peak during the step (counted from before the trainer is built) is the cost
    model's allocated bytes within 5% (measured: within 0.1%). Two micro-batches, so that the
    gradients exist when the last backward starts, as the model counts them."""
    import torch

    from tessera.profile.measure.validate import AllocatorWindow
    from tessera.runtime.trainer import TrainConfig, Trainer
    from tessera.spec.presets.clusters import local_cpu_cluster

    wl = Workload(global_batch=4, seq_len=384, dtype="fp32")
    plan = manual_plan(ModelSpec.from_config(TINY), local_cpu_cluster(1), wl, **extra)
    mem = plan.prediction.stage_memory[0]
    predicted = mem.total - mem.fragmentation - plan.cluster.device.reserved_bytes
    with AllocatorWindow(torch.device("cpu")) as window:
        trainer = Trainer(TrainConfig(plan=plan, steps=10, synthetic_data=True, seed=0))
        data = iter(trainer.build_data())
        batch = next(data)
        trainer.train_step(batch.tokens, batch.labels)  # optimizer state exists from here on
        batch = next(data)
        with window.measured():
            trainer.train_step(batch.tokens, batch.labels)
    trainer.close()
    assert predicted == pytest.approx(window.peak_bytes, rel=0.05)
