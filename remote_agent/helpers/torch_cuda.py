"""Run by the serving Python: torch.version.cuda read from torch/version.py without importing torch
(seconds on a GPU host): a version, "None" for a CPU build, "unknown" when it cannot be read; no
output when there is no torch.
"""

if __name__ not in ("__main__", "__mp_main__"):  # a program the agent runs (python -c, or a spawned child)
    raise ImportError(__name__ + " is a program the deploy agent runs, not a module to import")

import importlib.util
import os
import re

spec = importlib.util.find_spec("torch")
if spec is not None and spec.submodule_search_locations:
    with open(os.path.join(next(iter(spec.submodule_search_locations)), "version.py")) as f:
        found = re.search(r"^cuda\s*(?::[^=]*)?=\s*(?:'([^']*)'|\"([^\"]*)\"|None)", f.read(), re.M)
    print((found.group(1) or found.group(2) or "None") if found else "unknown")
