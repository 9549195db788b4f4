"""Run by the serving Python, in the background: the loader gate's view and the engine gate's
verdict in one process, so that transformers is imported once (vLLM imports it too) and both run
while the controller drains, pushes or launches.

stdin: one JSON object: ``timeout`` (s), ``loader`` (the loader_view helper's source and argv, or
null), ``engine`` (the engine_check helper's source, its argv and the directory it runs in, or
null). Each helper runs as its own script would (its argv, its ``__main__``): the loader's from
``/`` as the loader op runs it, then vLLM's from the server's directory. stdout: the loader's
answer after LOADER (or why it failed), the engine helper's own output and verdict, and at the end
DONE with the engine's exit status. Python 3.8+, standard library.
"""

if __name__ not in ("__main__", "__mp_main__"):  # a program the agent runs (python -c, or a spawned child)
    raise ImportError(__name__ + " is a program the deploy agent runs, not a module to import")

import contextlib
import io
import json
import os
import signal
import sys

LOADER = "@@dflash-loader@@"
DONE = "@@dflash-checks-done@@"

spec = json.loads(sys.stdin.read())
sys.stdin.close()
# Bounded by itself: the controller that started it may be gone by the time it would be waited for.
signal.alarm(max(1, int(spec["timeout"])))


def run(source, argv):
    """A helper as its own script: its argv and a ``__main__`` of its own."""
    sys.argv = ["-c", *argv]
    exec(compile(source, "<%s>" % argv[0] if argv else "<helper>", "exec"), {"__name__": "__main__"})


loader = spec.get("loader")
if loader:
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            run(loader["source"], loader["argv"])
        lines = said.getvalue().strip().splitlines()
        answer = {"view": json.loads(lines[-1])} if lines else {"error": "the loader printed nothing"}
    except BaseException as exc:  # whatever the load raised (or exited with) is the loader gate's answer
        answer = {"error": "%s: %s" % (type(exc).__name__, " ".join(str(exc).split())[:1000])}
    sys.stdout.write("\n" + LOADER + json.dumps(answer) + "\n")
    sys.stdout.flush()

code = None
engine = spec.get("engine")
if engine:
    os.chdir(engine["cwd"])
    try:
        run(engine["source"], engine["argv"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
sys.stdout.flush()
sys.stderr.flush()
sys.stdout.write("\n" + DONE + json.dumps({"code": code}) + "\n")
sys.stdout.flush()
os._exit(0)  # a thread vLLM left behind does not keep the answer waiting
