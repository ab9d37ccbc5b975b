"""The `cluster` tier (tests that start their own multi-node Ray cluster) runs only when asked
for by marker (`pytest -m cluster`): `make test`'s `-m "not real"` deselects it like the real
tier, since it needs several minutes and a machine quiet enough for Ray nodes to register."""

from __future__ import annotations


def pytest_collection_modifyitems(config, items):
    if "cluster" in (config.option.markexpr or ""):
        return
    chosen = [i for i in items if i.get_closest_marker("cluster") is None]
    if len(chosen) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("cluster")])
        items[:] = chosen
