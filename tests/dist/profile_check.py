"""Distributed checks of the profiler (run under torchrun on gloo by tests/test_profile_dist.py).

argv: OUT_DIR. Profiles the hardware (small messages) and a small model on every rank, checks the
results on every rank, and rank 0 writes cluster.json and model-profile.json into OUT_DIR for the
torch-free checks of the calling test. Rank 0 prints `CHECK <name> ok` per passed check.
"""
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tessera.profile.apply import write_atomic
from tessera.profile.measure.hardware import COLLECTIVES, HardwareOptions, detect_environment, planned_units, profile_hardware
from tessera.profile.measure.model import planned_units as model_units, profile_model
from tessera.spec.cluster import ClusterSpec
from tessera.spec.model import LayerKind, ModelSpec, TransformerConfig

SMALL = TransformerConfig(name="profile-test-llama", hidden=64, num_layers=2, num_heads=4, num_kv_heads=2,
                          ffn_hidden=128, vocab_size=512, max_seq_len=128)


def check(name, cond, detail=""):
    if not cond:
        raise SystemExit(f"CHECK {name} FAILED {detail}")
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def main():
    out = Path(sys.argv[1])
    env = detect_environment()
    # Up to 16 MiB: below ~1 MiB, gloo's per-call latency on a shared 2-core machine hides the
    # bandwidth term, so a curve that short can come out flat.
    opts = HardwareOptions(min_bytes=4096, max_bytes=1 << 24, reps=3, matmul_size=256, dtypes=("fp32",))
    done = []
    cluster = profile_hardware(opts, progress=lambda what, n: done.append(n), env=env)
    check("progress_units", sum(done) == planned_units(env, opts), f"{sum(done)} vs {planned_units(env, opts)}")
    check("shape", (cluster.num_nodes, cluster.gpus_per_node) == (1, env.world))
    again = ClusterSpec.model_validate_json(cluster.model_dump_json())
    check("json_round_trip", again == cluster)
    kinds = {(c.collective, c.group_size) for c in cluster.collectives}
    want = {(c, g) for c in COLLECTIVES for g in (2, env.world) if c != "p2p" or g == 2}
    check("all_collectives_and_groups", want <= kinds, f"missing {want - kinds}")
    for c in cluster.collectives:
        sizes_ok = list(c.message_bytes) == sorted(c.message_bytes) and c.message_bytes[0] == 4096
        check(f"curve_{c.collective}_{c.group_size}",
              sizes_ok and all(t > 0 for t in c.seconds)
              and all(b >= a for a, b in zip(c.seconds, c.seconds[1:]))
              # 4096x the bytes takes clearly longer (the curve is not flat noise)
              and c.seconds[-1] > 1.5 * c.seconds[0], str(c.seconds))
    check("cpu_peak_is_measured", cluster.compute_efficiency == 1.0 and cluster.device.peak_flops["fp32"] > 1e8)
    check("link_fitted", cluster.intra_node.bandwidth > 1e6 and cluster.intra_node.latency >= 0)
    check("overlap", 1.0 <= cluster.overlap_slowdown <= 3.0)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    check("oversubscription", cluster.oversubscription == max(1.0, env.world * torch.get_num_threads() / cores),
          str(cluster.oversubscription))

    spec = ModelSpec.from_config(SMALL)
    sizes = [(1, 32), (2, 32), (1, 64), (2, 64), (1, 128)]
    steps = []
    # A window of a few runs: every rank must agree on how many, or their barriers deadlock.
    profile = profile_model(spec, sizes=sizes, reps=2, matmul_size=256, progress=lambda w, n: steps.append(n),
                            window_s=0.005)
    check("model_window", profile.window_s == 0.005)
    check("model_progress", sum(steps) == model_units(spec, world=env.world, reps=2))
    check("model_kinds", [k.kind for k in profile.layers] == [LayerKind.EMBEDDING, LayerKind.DECODER, LayerKind.LM_HEAD])
    block = profile.for_kind(LayerKind.DECODER)
    check("block_measured", len(block.measurements) == len(sizes)
          and all(m.forward_s > 0 and m.backward_s > 0 for m in block.measurements))
    # Saved activations grow linearly with tokens: bytes per token equal across sizes.
    per_token = [m.activation_bytes / m.tokens for m in block.measurements]
    check("activations_per_token", max(per_token) / min(per_token) < 1.05, str(per_token))
    pair = env.world % 2 == 0
    for variant, over in (("tp2", "tp"), ("sp2", "sp"), ("zero3", "zero3")):
        seconds, comm = getattr(block, f"{variant}_seconds"), getattr(block, f"{variant}_comm_seconds")
        check(f"{variant}_measured", (getattr(block, f"{over}_overhead_s") is not None) == pair and block.overhead_s >= 0
              and (not pair or (len(seconds) == len(sizes) and all(t > 0 for t in seconds)
                                and all(x > 0 for x in comm))), str(seconds))
    chain = block.chain_reference_seconds
    check("chain_reference", (chain is not None) == pair and (not pair or (len(chain) == len(sizes) and min(chain) > 0)),
          str(chain))
    head = profile.for_kind(LayerKind.LM_HEAD)
    check("head_tp2_measured", (head.tp_overhead_s is not None and head.tp_slowdown is not None) == pair
          and head.sp_overhead_s is None and head.zero3_overhead_s is None
          and (not pair or (len(head.tp2_seconds) == len(sizes) == len(head.chain_reference_seconds)
                            and min(head.tp2_seconds) > 0 and min(head.tp2_comm_seconds) > 0)), str(head.tp2_seconds))
    check("scales_positive", block.linear_time_scale > 0 and block.attn_time_scale > 0 and profile.ranks_measuring == env.world)
    if env.rank == 0:
        write_atomic(out / "cluster.json", cluster.model_dump_json(indent=1))
        write_atomic(out / "model-profile.json", profile.model_dump_json(indent=1))
        check("written_without_leftovers", sorted(p.name for p in out.iterdir()) == ["cluster.json", "model-profile.json"])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
