"""The GPU fast path, in the parts a CPU can check: AdamW's implementation (fused where the kernel
takes the parameter list), clipping without a host round trip, the number formats, bf16 logits
lost in fp32, and step records read one step late (as on CUDA) equal to records read at once."""
import pytest
import torch
import torch.distributed as dist

from tessera.errors import TesseraError
from tessera.runtime.optim import OptimConfig, build_optimizer, clip_grad_norm_, implementation
from tessera.runtime.precision import autocast, compute_dtype, fsdp_mixed_precision, peak_dtype


@pytest.fixture(scope="module")
def one_rank():
    """A one-process gloo group (and meshes on it) for DTensor parameters and the Trainer."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def _meshes():
    from torch.distributed.device_mesh import init_device_mesh

    return (init_device_mesh("cpu", (1,), mesh_dim_names=("a",)),
            init_device_mesh("cpu", (1, 1), mesh_dim_names=("x", "y")))


def _dtensor(mesh, shape, seed):
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(seed)
    return torch.nn.Parameter(distribute_tensor(torch.randn(*shape), mesh, [Shard(0)] * mesh.ndim))


def test_adamw_implementation_choice(one_rank):
    plain = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]
    # CPU parameters: foreach unless fusing is asked for (the CPU has a fused kernel too).
    assert implementation(plain) == {"fused": False, "foreach": True}
    assert implementation(plain, fused=True) == {"fused": True, "foreach": False}
    assert implementation(plain, fused=False) == {"fused": False, "foreach": True}
    one, two = _meshes()
    same_mesh = [_dtensor(one, (4, 4), 0), _dtensor(one, (4,), 1)]
    assert implementation(same_mesh, fused=True)["fused"]
    # The fused kernel cannot take plain tensors beside DTensors, nor (before recent torch) DTensors
    # of several meshes: those stay unfused.
    assert implementation(same_mesh + plain, fused=True) == {"fused": False, "foreach": False}
    assert implementation([same_mesh[0], _dtensor(two, (4, 4), 2)], fused=True) == {"fused": False, "foreach": True}


def test_fused_adamw_on_dtensors_matches_foreach(one_rank):
    one, _ = _meshes()
    runs = {}
    for fused in (True, False):
        params = [_dtensor(one, (8, 4), 0), _dtensor(one, (4,), 1)]
        opt = build_optimizer(params, OptimConfig(fused=fused))
        assert opt.param_groups[0]["fused"] is fused
        for step in range(3):
            torch.manual_seed(10 + step)
            for p in params:
                p.grad = torch.distributed.tensor.distribute_tensor(torch.randn(p.shape), one, p.placements)
            opt.step()
        runs[fused] = [p.full_tensor().detach() for p in params]
    for a, b in zip(runs[True], runs[False]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_clip_keeps_the_norm_on_the_device_and_matches_torch(one_rank):
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(8))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for p, q in zip(ours, ref):
        p.grad = torch.randn(p.shape) * 3
        q.grad = p.grad.clone()
    norm = clip_grad_norm_(ours, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0
    torch.testing.assert_close(norm, expected)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.grad, q.grad)
    # Under the bound every gradient is left exactly as it was.
    before = [p.grad.clone() for p in ours]
    clip_grad_norm_(ours, 100.0)
    assert all(torch.equal(p.grad, b) for p, b in zip(ours, before))


def test_clip_scales_dtensor_gradients_in_place(one_rank):
    one, two = _meshes()
    params = [_dtensor(one, (4, 4), 0), _dtensor(two, (4, 2), 1)]
    for p in params:
        p.grad = torch.distributed.tensor.distribute_tensor(torch.full(p.shape, 2.0), p.device_mesh, p.placements)
    total = (16 + 8) ** 0.5 * 2.0
    norm = clip_grad_norm_(params, 1.0)
    assert float(norm) == pytest.approx(total)
    for p in params:
        assert p.grad.full_tensor().norm().item() == pytest.approx(2.0 * p.numel() ** 0.5 / total, rel=1e-5)


def test_number_formats():
    with pytest.raises(TesseraError, match="fp16 needs loss scaling"):
        compute_dtype("fp16", "cuda")
    assert compute_dtype("bf16", "cuda") == "bf16"
    assert compute_dtype("bf16", "cpu") == "fp32"
    policy = fsdp_mixed_precision("bf16")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fsdp_mixed_precision("fp32") is None
    assert peak_dtype("fp32", "cpu") == "fp32" and peak_dtype("bf16", "cuda") == "bf16"
    with autocast("cpu", "bf16"):
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.bfloat16
    with autocast("cpu", "fp32"):
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32


def _trainer(on_step=None):
    from tessera.runtime.trainer import TrainConfig, Trainer
    from tessera.search.baselines import manual_plan
    from tessera.spec.model import ModelSpec, TransformerConfig
    from tessera.spec.presets.clusters import local_cpu_cluster
    from tessera.spec.workload import Workload

    config = TransformerConfig(name="fast-path-llama", hidden=32, num_layers=2, num_heads=4, num_kv_heads=2,
                               ffn_hidden=64, vocab_size=128, max_seq_len=16)
    plan = manual_plan(ModelSpec.from_config(config), local_cpu_cluster(1),
                       Workload(global_batch=2, seq_len=16, dtype="bf16"), micro_batch_size=2)
    return Trainer(TrainConfig(plan=plan, steps=3, synthetic_data=True, seed=0,
                               optim=OptimConfig(lr=1e-2, warmup_steps=1, grad_clip=0.5)), on_step=on_step)


def test_records_read_a_step_late_equal_records_read_at_once(one_rank):
    runs = {}
    for defer in (False, True):
        seen = []
        trainer = _trainer(on_step=seen.append)
        trainer.defer_records = defer
        records = trainer.train()
        trainer.close()
        assert [r.step for r in records] == [r.step for r in seen] == [1, 2, 3]
        assert all(r.step_time_s > 0 and r.peak_memory_bytes and isinstance(r.loss, float) for r in records)
        runs[defer] = [(r.step, r.loss, r.grad_norm, r.lr) for r in records]
    assert runs[True] == runs[False]


def test_run_step_returns_the_loss_as_a_tensor_and_loss_is_fp32(one_rank):
    trainer = _trainer()
    batch = next(iter(trainer.build_data()))
    loss = trainer.run_step(batch.tokens, batch.labels)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and isinstance(trainer.grad_norm, torch.Tensor)
    # bf16 logits (what autocast and FSDP2's policy give) are lost in fp32.
    logits = torch.randn(2, 16, 128, dtype=torch.bfloat16)
    assert trainer.loss_fn(logits, batch.labels).dtype == torch.float32
    trainer.close()
