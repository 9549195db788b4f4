"""Pure decisions: what a run asks of a host and what the answers mean (``plan``), the drafter's
lint and the vLLM build table (``dflash``), models and weights, GPUs, multi-node placement, the
server's command, the probe's statistics and watch's states. No I/O."""
