"""The lint gate proves the drafter config is sound and fits its target.

Every rule in `orchestrator/rules/dflash/lint.py` (the rules table: [what lint knows](lint.md)),
against the target's `config.json` and a pinned reference; an error stops the deploy before any host
is touched.
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.config.inventory import Target
from orchestrator.config.playbook import Playbook
from orchestrator.results import (
    Gate,
    Problem,
)
from orchestrator.rules import dflash, serving


def lint_playbook(playbook: Playbook, targets: Sequence[Target] = ()) -> list[Problem]:
    """The lint gate: the drafter config against the target's config and the pinned reference, at
    the tensor parallel size each of ``targets`` will serve it (before any host is touched)."""
    if playbook.drafter is None:
        return []
    s = playbook.serving
    served = s.target is not None and s.speculative
    return dflash.lint(
        playbook.drafter.values,
        playbook.drafter.target,
        playbook.drafter.reference,
        num_speculative_tokens=s.num_speculative_tokens,
        pipeline_parallel_size=s.pipeline_parallel_size if s.speculative else 1,
        serving_args=s.extra_args,
        tensor_parallel_sizes=[serving.tensor_parallel_size(playbook, t.container) for t in targets] if served else [],
    )


def lint_gate(playbook: Playbook, problems: list[Problem]) -> Gate | None:
    """Every host's lint gate (None: no drafter config, nothing to lint)."""
    if playbook.drafter is None:
        return None
    errors = sum(p.severity == "error" for p in problems)
    if errors:
        return Gate(
            False,
            f"not attempted: the drafter config has {errors} lint error{'s' if errors != 1 else ''} (deploy stopped "
            "before touching any host)",
        )
    drafter = playbook.drafter
    checked = " and ".join(
        what for what, present in (("target config", drafter.target), ("reference", drafter.reference)) if present
    )
    warnings = f" ({len(problems)} warning{'s' if len(problems) != 1 else ''})" if problems else ""
    return Gate(True, f"drafter config passes against {checked or 'its own rules'}{warnings}")
