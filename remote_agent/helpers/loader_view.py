"""Run by the serving Python: the drafter config as its transformers loads it (the loader gate).

argv: the drafter directory, and a JSON list of the fields to report. Prints one JSON line, with
what the view depends on (``where``): the interpreter, the import path's directories and every
transformers source file imported, which the agent stamps to know when the view may be reused.
"""

if __name__ not in ("__main__", "__mp_main__"):  # a program the agent runs (python -c, or a spawned child)
    raise ImportError(__name__ + " is a program the deploy agent runs, not a module to import")

import json
import os
import sys

import transformers
from transformers import AutoConfig

config = AutoConfig.from_pretrained(sys.argv[1])
fields = {}
for name in json.loads(sys.argv[2]):
    value = getattr(config, name, "<absent>")
    try:
        json.dumps(value)
    except TypeError:
        value = repr(value)
    fields[name] = value
files = set()
for n, m in list(sys.modules.items()):
    f = getattr(m, "__file__", None)
    if (n == "transformers" or n.startswith("transformers.")) and f:
        files.add(os.path.realpath(f))
where = {
    "executable": os.path.realpath(sys.executable),
    "paths": sorted(set(os.path.realpath(x or os.getcwd()) for x in sys.path if os.path.isdir(x or os.getcwd()))),
    "files": sorted(files),
}
print(
    json.dumps(
        {"class": type(config).__name__, "transformers": transformers.__version__, "fields": fields, "where": where}
    )
)
