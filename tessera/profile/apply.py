"""Load measured profiles and fold them into the planner's specs (no torch import).

- `load_cluster_profile(path, expect_gpus)`: the ClusterSpec JSON of `tessera profile hardware`,
  refused when it describes another number of devices than the one planned for.
- `apply_model_profile(model, profile)`: the ModelSpec with each layer's measured time scales,
  fixed overheads (`call_overhead_s`, `tp_overhead_s`, `sp_overhead_s`, `zero3_overhead_s`),
  TP / Ulysses compute slowdowns (`tp_slowdown`, `sp_slowdown`; all 0 where not measured), TP's
  two terms at wider degrees where measured (`tp_wider`) and
  activation bytes; refused when the profile was measured on another model.

Activation bytes: the profile measures B bytes per token per layer (all saved tensors, one device,
no tensor parallelism, no recompute). The spec splits a layer's bytes into `act_bytes_tp` and
`act_bytes_replicated` (plus the droppable `act_bytes_selective` part and the full-recompute
`act_bytes_input`); all four are multiplied by B / (act_bytes_tp + act_bytes_replicated), so the
split's proportions (what TP and SP divide) stay the spec's and the total becomes the measured one.
When the profile measured the split (a block also measured as one rank's tp=2 shard), the TP
part is the measured one and the rest is replicated. The kept input of full recompute is exactly
`hidden` elements of the profile's dtype per token. A layer the spec gives no activations (the
embedding) gets B as replicated bytes.
"""
from __future__ import annotations

import os
from pathlib import Path

from pydantic import ValidationError

from ..errors import TesseraError
from ..spec.jsonio import first_validation_error, read_json_object
from ..spec.cluster import ClusterSpec
from ..spec.model import LayerSpec, ModelSpec, TPDegreeCost
from .fit import PARALLEL_COSTS, PROFILE_VERSION, ModelProfile


def write_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the whole new one, never half.

    Writes a temporary file beside it, flushes it to disk, then renames it over `path`.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_cluster_profile(path: str | Path, expect_gpus: int | None = None,
                         expect_gpus_per_node: int | None = None) -> ClusterSpec:
    """The ClusterSpec in `path`; refused if it describes another number of devices (or per node)."""
    data = read_json_object(path, "cluster profile")
    try:
        cluster = ClusterSpec.model_validate(data)
    except ValidationError as e:
        raise TesseraError(f"cluster profile {path} is not a cluster spec: {first_validation_error(e)}") from None
    shape = f"{cluster.num_nodes} node(s) x {cluster.gpus_per_node} device(s)"
    if expect_gpus is not None and cluster.num_gpus != expect_gpus:
        raise TesseraError(
            f"cluster profile {path} was measured on {shape} = {cluster.num_gpus} devices, not the "
            f"{expect_gpus} asked for; profile again with {expect_gpus} ranks")
    if expect_gpus_per_node is not None and cluster.gpus_per_node != expect_gpus_per_node:
        raise TesseraError(
            f"cluster profile {path} was measured with {cluster.gpus_per_node} devices per node, "
            f"not {expect_gpus_per_node}; profile again on this layout")
    return cluster


def load_model_profile(path: str | Path) -> ModelProfile:
    data = read_json_object(path, "model profile")
    if data.get("version") != PROFILE_VERSION:
        raise TesseraError(f"model profile {path} has version {data.get('version')}, this Tessera reads "
                           f"version {PROFILE_VERSION}; profile again")
    try:
        return ModelProfile.model_validate(data)
    except ValidationError as e:
        raise TesseraError(f"model profile {path} is not a model profile: {first_validation_error(e)}") from None


_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _scaled_layer(layer: LayerSpec, profile: ModelProfile) -> LayerSpec:
    kp = profile.for_kind(layer.kind)
    if kp is None:
        return layer
    spec_bytes = layer.act_bytes_tp + layer.act_bytes_replicated
    measured = kp.activation_bytes_per_token
    if spec_bytes > 0:
        r = measured / spec_bytes
        tp = layer.act_bytes_tp * r
        if kp.activation_bytes_tp_per_token is not None and layer.act_bytes_tp > 0:
            tp = kp.activation_bytes_tp_per_token  # the measured split
        acts = dict(act_bytes_tp=tp, act_bytes_replicated=measured - tp,
                    act_bytes_selective=layer.act_bytes_selective * tp / layer.act_bytes_tp if layer.act_bytes_tp else 0.0,
                    act_bytes_input=layer.act_bytes_input * r)
        if layer.act_bytes_input > 0 and profile.dtype in _ELEMENT_BYTES:
            # Full recompute keeps exactly the block input: hidden elements per token.
            acts["act_bytes_input"] = float(layer.hidden * _ELEMENT_BYTES[profile.dtype])
    else:
        acts = dict(act_bytes_replicated=measured)
    return layer.model_copy(update=dict(compute_measured=True, linear_time_scale=kp.linear_time_scale,
                                        attn_time_scale=kp.attn_time_scale, call_overhead_s=kp.overhead_s,
                                        **{f: getattr(kp, f) or 0.0 for f in PARALLEL_COSTS},
                                        tp_wider=tuple(TPDegreeCost(degree=w.degree, overhead_s=w.overhead_s,
                                                                    slowdown=w.slowdown) for w in kp.tp_wider),
                                        **acts))


def refuse_other_model(profile: ModelProfile, model: ModelSpec) -> None:
    """Raise unless `profile` was measured on a model of `model`'s name."""
    if profile.model != model.name:
        raise TesseraError(f"model profile was measured on model '{profile.model}', not '{model.name}'; "
                           f"run `tessera profile model --model {model.name}`")


def apply_model_profile(model: ModelSpec, profile: str | Path | ModelProfile) -> ModelSpec:
    """`model` with every layer's time scales, overheads and activation bytes from the profile of its kind.

    Refuses a profile of another model, or of a model of the same name whose layers differ.
    """
    prof = profile if isinstance(profile, ModelProfile) else load_model_profile(profile)
    refuse_other_model(prof, model)
    for kp in prof.layers:
        same = [l for l in model.layers if l.kind == kp.kind]
        if same and (same[0].params != kp.params or same[0].flops_per_token != kp.flops_per_token):
            raise TesseraError(
                f"model profile of '{prof.model}' does not match this '{model.name}': its {kp.kind.value} layer "
                f"has {kp.params:,} parameters, here {same[0].params:,}; profile this model again")
    layers = tuple(_scaled_layer(layer, prof) for layer in model.layers)
    return model.model_copy(update={"layers": layers})
