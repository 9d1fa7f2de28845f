from .clusters import DEVICES, gpu_names, local_cpu_cluster, make_cluster, UnknownGPUError
from .models import MODEL_CONFIGS, UnknownModelError, get_model, get_model_config, model_names

__all__ = ["DEVICES", "gpu_names", "local_cpu_cluster", "make_cluster", "UnknownGPUError",
           "MODEL_CONFIGS", "UnknownModelError", "get_model", "get_model_config", "model_names"]
