"""The real megatron-core optimizer stacks, run on a CPU (see ``shim`` and ``harness``)."""
