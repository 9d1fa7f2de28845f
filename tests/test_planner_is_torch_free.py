"""The planner side must plan for 1,024 GPUs on a laptop: importing it never imports torch."""
import subprocess
import sys


def test_planner_modules_do_not_import_torch():
    code = (
        "import sys, importlib, pkgutil, tessera\n"
        "for pkg in ['tessera.spec', 'tessera.cost', 'tessera.search', 'tessera.adapt']:\n"
        "    m = importlib.import_module(pkg)\n"
        "    for info in pkgutil.walk_packages(m.__path__, pkg + '.'):\n"
        "        importlib.import_module(info.name)\n"
        "import tessera.plan, tessera.cli\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
