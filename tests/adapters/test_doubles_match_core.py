"""The DistributedOptimizer double against the installed megatron-core: drift fails here.

``tests/doubles/distributed.py`` stands in for Core's DistributedOptimizer inside the real
``ChainedOptimizer``, with ``SimpleNamespace`` configs. Every supported Core (0.16.1 to 0.19.2;
``.ci/megatron_env`` runs these tests against the newest) must find on them each config field
its ``ChainedOptimizer`` reads, and each field they carry must be one of that Core's, at Core's
default wherever the double does not choose the value itself.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from importlib.metadata import version

import pytest

pytest.importorskip("megatron.core.optimizer")
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import ChainedOptimizer
from packaging.version import Version

from tests.doubles.distributed import CORE_DEFAULTS, FIELDS_SINCE, ddp_config, megatron_config

# Not megatron.core.__version__: that one carries the current directory's git hash.
CORE_VERSION = version("megatron-core")
CORE_RELEASE = Version(CORE_VERSION).release[:2]


def config_reads(cls: type) -> set[str]:
    """Every ``NAME`` in an ``<expression>.config.NAME`` of the class's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "config"
    }


def test_the_double_has_every_config_field_chained_optimizer_reads() -> None:
    reads = config_reads(ChainedOptimizer)
    # The scan sees the reads every supported Core's ChainedOptimizer.step makes.
    assert {"clip_grad", "log_num_zeros_in_grad"} <= reads
    missing = reads - set(vars(megatron_config()))
    assert not missing, (
        f"megatron-core {CORE_VERSION}'s ChainedOptimizer reads config fields the double lacks: "
        f"{sorted(missing)}; add them to CORE_DEFAULTS in tests/doubles/distributed.py with "
        "Core's defaults (and to FIELDS_SINCE if older supported Cores lack them)"
    )


def test_the_doubles_config_fields_are_cores_at_cores_defaults() -> None:
    real = OptimizerConfig()
    fields = {field.name for field in dataclasses.fields(OptimizerConfig)}
    assert set(FIELDS_SINCE) <= set(CORE_DEFAULTS)
    for name, value in vars(megatron_config()).items():
        since = FIELDS_SINCE.get(name)
        if since is not None and since > CORE_RELEASE:
            assert name not in fields, (
                f"megatron-core {CORE_VERSION} has {name}: FIELDS_SINCE says it came in {since}"
            )
            continue
        assert hasattr(real, name), (
            f"the double's config has {name!r}, which megatron-core {CORE_VERSION}'s "
            "OptimizerConfig does not: remove or rename it in tests/doubles/distributed.py"
        )
        if name in CORE_DEFAULTS:
            assert getattr(real, name) == value, (
                f"{name}: the double has {value!r}, megatron-core {CORE_VERSION}'s default is "
                f"{getattr(real, name)!r}"
            )


def test_the_doubles_ddp_config_fields_are_cores() -> None:
    fields = {field.name for field in dataclasses.fields(DistributedDataParallelConfig)}
    for megatron_fsdp in (False, True):
        extra = set(vars(ddp_config(megatron_fsdp=megatron_fsdp))) - fields
        assert not extra, (
            f"megatron-core {CORE_VERSION}'s DistributedDataParallelConfig has no {sorted(extra)}"
        )


# The double's own construction helpers; everything else it defines is Core's surface.
DOUBLE_ONLY = {
    "of_model",
    "_optimizer_param",
    "_precision_aware",
    "_holder",
    "_parameter_state",
    "_fully_reshardable",
    "_scaffold",
}


def test_the_doubles_methods_are_distributed_optimizers_with_its_signatures() -> None:
    """What the library and Core's ChainedOptimizer call on the double (its methods,
    properties and the reshardable-format set) is the real DistributedOptimizer's, by name
    and parameter names, so code that runs against the double calls what Core has."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from tests.doubles.distributed import DistributedOptimizerDouble

    surface = {
        name: value
        for name, value in vars(DistributedOptimizerDouble).items()
        if not name.startswith("__") and name not in DOUBLE_ONLY
    }
    assert {"_set_main_param_and_optimizer_states", "sharded_state_dict", "step"} <= set(surface)
    for name, value in surface.items():
        real = inspect.getattr_static(DistributedOptimizer, name, None)
        assert real is not None, (
            f"megatron-core {CORE_VERSION}'s DistributedOptimizer has no {name!r}; rename it in "
            "tests/doubles/distributed.py, or list it in DOUBLE_ONLY if it is the double's own"
        )
        if isinstance(value, property):
            assert isinstance(real, property), f"{name}: a property on the double only"
        elif isinstance(value, (set, frozenset)):
            assert value <= set(real), f"{name}: {sorted(value)} not all in Core's {real}"
        else:
            ours = list(inspect.signature(value).parameters)
            assert ours == list(inspect.signature(real).parameters), (
                f"{name}{inspect.signature(value)} differs from Core's {inspect.signature(real)}"
            )
