"""Plain data: what is trained (model), on what (cluster), and how much per step (workload)."""
from .cluster import ClusterSpec, CollectiveCurve, DeviceSpec, LinkSpec
from .model import LayerKind, LayerSpec, ModelSpec, TransformerConfig
from .workload import Workload

__all__ = ["ClusterSpec", "CollectiveCurve", "DeviceSpec", "LinkSpec", "LayerKind", "LayerSpec",
           "ModelSpec", "TransformerConfig", "Workload"]
