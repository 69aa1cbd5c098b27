"""Ports of other frameworks' entry points onto wrapped stacks.

* :mod:`wrapped_optim.integrations.bridge` -- Megatron-Bridge's ``setup_optimizer`` and
  ``SchedulerConfig``.
"""

__all__: list[str] = []
