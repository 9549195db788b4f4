"""Programs the serving Python runs on this machine, never part of the installed controller.

- ``tinymodels.py``: the sandbox's tiny hand-weighted target and drafters (torch, transformers).
- ``vllmverdict.py``: what real vLLM does with a published drafter/target pair, shrunk to CPU size.

Each runs as a script with the vLLM venv's interpreter; the unit tests import their pure parts.
"""
