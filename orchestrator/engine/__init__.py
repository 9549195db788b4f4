"""The run engine and its verbs: units fanned out under a rollout policy (``runner``), the runs a
user asks for (``runs``), starting and proving servers (``launch``), pushing model files
(``push``), gateway rotation (``rotation``) and watch rounds (``watcher``)."""
