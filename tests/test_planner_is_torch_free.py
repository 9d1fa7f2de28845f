"""The planner side must plan for 1,024 GPUs on a laptop: importing it never imports torch.

That includes the profile's torch-free half (`tessera.profile` outside `tessera.profile.measure`):
reading, fitting and applying profiles, and the records of validation runs with their predictions.
"""
import subprocess
import sys


def test_planner_modules_do_not_import_torch():
    code = (
        "import sys, importlib, pkgutil, tessera\n"
        "for pkg in ['tessera.spec', 'tessera.cost', 'tessera.search', 'tessera.adapt', 'tessera.profile']:\n"
        "    m = importlib.import_module(pkg)\n"
        "    for info in pkgutil.walk_packages(m.__path__, pkg + '.'):\n"
        "        if info.name.startswith('tessera.profile.measure'):\n"
        "            continue\n"
        "        importlib.import_module(info.name)\n"
        "import tessera.plan, tessera.cli\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        # Using the profile's torch-free half stays torch-free too: fits and predictions.
        "from tessera.profile.fit_hardware import fit_link, monotone\n"
        "from tessera.profile.results import Validation, predicted_allocated, predicted_memory\n"
        "from tessera.search.baselines import manual_plan\n"
        "from tessera.spec.presets.clusters import make_cluster\n"
        "from tessera.spec.presets.models import get_model\n"
        "from tessera.spec.workload import Workload\n"
        "plan = manual_plan(get_model('tiny-llama'), make_cluster('h100-80gb', 8, 8), Workload(global_batch=8, "
        "seq_len=256), zero=3)\n"
        "assert len(predicted_allocated(plan)) == len(predicted_memory(plan)) == 1\n"
        "assert monotone([3.0, 1.0, 2.0]) == [1.0, 1.0, 2.0]\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
