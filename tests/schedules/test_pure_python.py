"""schedules never imports torch: every module imports and runs with torch blocked."""

import subprocess
import sys

BLOCKED = """
import importlib, importlib.abc, pkgutil, sys

class BlockTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
        return None

sys.meta_path.insert(0, BlockTorch())
import schedules
for module in pkgutil.walk_packages(schedules.__path__, "schedules."):
    if module.name != "schedules.__main__":
        importlib.import_module(module.name)
schedules.validate(schedules.build_schedule("interleaved", 4, 8, 2))
print(schedules.simulate(schedules.build_schedule("1f1b", 4, 8)).makespan)
assert "torch" not in sys.modules
"""


def test_schedules_works_with_torch_blocked() -> None:
    result = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "33.0"
