"""`--init-from` under many plans at 4 ranks (shards of 2 and 4 ranks), in one launch.

argv: WORK (prepared by tests/test_hf_finetune.py: WORK/<family>/hf, WORK/data, WORK/expected.json).
Per family and plan, on every rank:
  - the loaded weights, gathered, equal the checkpoint's (built on meta where the plan allows:
    each rank reads only its own shards; reading again counts the bytes: exactly the local shards);
  - the first step's loss equals transformers' loss on the same global batch (chat and text data
    tokenized with the model's tokenizer, assistant-only targets, packed documents), and the second
    step's equals a one-process run (the gradients of the masked, packed batch are exact);
  - a checkpoint is written (WORK/<family>/ckpt) for the export test.
Then one plan's first gradients, taken apart, equal a one-process backward of the global batch.
Rank 0 prints `CHECK <name> ok` per check.
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hf_fixtures import STEPS, global_batch, optim_config, tessera_loss  # noqa: E402
from runtime_common import S, make_plan  # noqa: E402

from tessera.models import hf  # noqa: E402
from tessera.models.hf_load import canonical_name, hf_model_config, load_hf_shards  # noqa: E402
from tessera.runtime.trainer import TrainConfig, Trainer  # noqa: E402

WORK = Path(sys.argv[1])
EXPECTED = json.loads((WORK / "expected.json").read_text())
SEQ, GB = 32, 8


def ok(name: str) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def plans(family: str):
    """(name, plan, build on meta) per family; every plan is for 4 ranks."""
    cfg = hf_model_config(WORK / family / "hf")
    n_layers = cfg.num_layers + 2

    def plan(strategies, **kw):
        return make_plan(cfg, 4, strategies, global_batch=GB, seq_len=SEQ, **kw)

    return {
        "llama": [("llama_zero3_dp4_meta", plan(S(dp=4, zero=3), num_micro_batches=2), True),
                  ("llama_pp2_dp2_full", plan(S(dp=2, zero=3), num_micro_batches=2,
                                              stages=((0, 2), (2, n_layers))), False)],
        "qwen2": [("qwen2_tied_hsdp_shard2_meta", plan(S(dp=4, zero=3, dp_shard=2)), True)],
        "mistral": [("mistral_ddp_dp4_full", plan(S(dp=4)), False)],
        "mixtral": [("mixtral_zero2_dp2_tp2_sp_meta", plan(S(dp=2, tp=2, zero=2, sp="megatron")), True)],
        "gpt2": [("gpt2_tied_tp4_meta", plan(S(tp=4, sp="megatron")), True)],
    }[family]


def check_family(family: str, name: str, plan, meta: bool, checkpoint: bool) -> None:
    hf_dir, data = WORK / family / "hf", WORK / "data"
    trainer = Trainer(TrainConfig(plan=plan, steps=STEPS, optim=optim_config(), seed=0, data=str(data),
                                  init_from=str(hf_dir),
                                  checkpoint_dir=str(WORK / family / "ckpt") if checkpoint else None))
    cfg = plan.model.config
    _, want = hf.load_hf_checkpoint(hf_dir)
    for part in trainer.model_parts:
        for pname, p in part.named_parameters():
            key = canonical_name(pname)
            ref = want["tok_embeddings.weight"] if key == "output.weight" and cfg.tie_embeddings else want[key]
            if not torch.equal(full(p).detach().cpu(), ref):
                raise AssertionError(f"{name}: {key} differs from the checkpoint after loading")
    if meta:  # reading again counts what each rank reads: its own shards and nothing more
        stats = load_hf_shards(trainer.model_parts, hf_dir, cfg)
        total = sum(t.numel() * t.element_size() for t in want.values())
        if stats.bytes_read != stats.local_bytes or stats.bytes_read > 0.75 * total:
            raise AssertionError(f"{name}: read {stats.bytes_read} bytes for {stats.local_bytes} bytes of shards "
                                 f"(model: {total})")
    records = trainer.train()
    trainer.close()
    first, second = EXPECTED[family]["transformers_first_loss"], EXPECTED[family]["one_process"][1]
    if abs(records[0].loss - first) > 1e-5 * abs(first):
        raise AssertionError(f"{name}: first loss {records[0].loss:.8f} != transformers' {first:.8f}")
    if abs(records[1].loss - second) > 2e-5 * abs(second):
        raise AssertionError(f"{name}: second loss {records[1].loss:.8f} != one process {second:.8f}")
    ok(name)


def check_gradients() -> None:
    """First-step gradients of a layer-wise plan with micro-batches equal one process's, tensor by tensor."""
    family = "llama"
    hf_dir = WORK / family / "hf"
    cfg = hf_model_config(hf_dir)
    # Blocks replicated over 4 ranks, the head's pieces over 2 (a rescale of 2), micro-batches with
    # different target counts: the normalisation by the global count is what makes this exact.
    plan = make_plan(cfg, 4, [S(dp=2, tp=2), S(dp=4, zero=3), S(dp=4, zero=2), S(dp=2, tp=2, sp="megatron")],
                     num_micro_batches=2, global_batch=GB, seq_len=SEQ)
    trainer = Trainer(TrainConfig(plan=plan, steps=1, optim=optim_config(), seed=0, init_from=str(hf_dir)))
    batch = global_batch(hf_dir, WORK / "data", 0)
    rows = [trainer.local_rows(t) for t in (batch.tokens, batch.labels, batch.positions, batch.doc_ids)]
    trainer.loss_fn.target_scale = trainer.loss_fn.pieces * plan.num_micro_batches / batch.num_targets
    trainer.forward_backward(*rows)
    trainer.parallel.rescale_grads()
    model = hf.load_pretrained(hf_dir)
    tessera_loss(model, batch).backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    for pname, p in trainer.parallel.module.named_parameters():
        got, ref = full(p.grad), want[canonical_name(pname)]
        if not torch.allclose(got, ref, rtol=1e-5, atol=1e-6 * ref.abs().max()):
            raise AssertionError(f"gradient of {pname}: max error {(got - ref).abs().max():.3e} "
                                 f"(max {ref.abs().max():.3e})")
    trainer.close()
    ok("gradients_masked_packed_layerwise_microbatch2")


for family in ("llama", "qwen2", "mistral", "mixtral", "gpt2"):
    for i, (name, plan, meta) in enumerate(plans(family)):
        check_family(family, name, plan, meta, checkpoint=i == 0)
check_gradients()
