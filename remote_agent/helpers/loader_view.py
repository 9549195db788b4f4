"""Run by the serving Python: the drafter config as its transformers loads it (the loader gate).

argv: the drafter directory, and a JSON list of the fields to report. Prints one JSON line.
"""

import json
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
print(json.dumps({"class": type(config).__name__, "transformers": transformers.__version__, "fields": fields}))
