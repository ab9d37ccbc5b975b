"""A stage run inside the ingress replica, called exactly as its deployment handle would be.

The ingress takes its stages as handles (``guard.check_input.remote(...)``, awaited, maybe
cancelled). ``LocalStage`` gives the same three operations for an instance of the stage's own
class, built in the ingress replica: a Serve hop fewer (a hop costs ~1.6 ms of CPU on both
sides, ``benchmarks/serve_hop.py``), at the price of the stage scaling with the ingress.

It crosses Serve's deployment arguments as the class's import path and its arguments
(picklable, small); ``start()`` builds the instance in the replica that received it. A path,
not the class: a Serve deployment's module name holds the ``Deployment``, not the class, so
cloudpickle would pickle the class by value, and unpickling it in the same process (Serve's
build does, to swap bound applications for handles) overwrites the class's methods with copies
bound to a private globals dict.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Generator
from typing import Any


class LocalResponse:
    """What ``.remote()`` returns: awaitable once, and ``cancel()`` stops the call (as
    ``DeploymentResponse.cancel`` does). The call runs from the moment it was made."""

    def __init__(self, future: asyncio.Future) -> None:
        self._future = future

    def __await__(self) -> Generator[Any, None, Any]:
        return self._future.__await__()

    def cancel(self) -> None:
        self._future.cancel()


class _Method:
    def __init__(self, instance: Any, name: str) -> None:
        self._bound = getattr(instance, name)

    def remote(self, *args: Any, **kwargs: Any) -> LocalResponse:
        return LocalResponse(asyncio.ensure_future(self._bound(*args, **kwargs)))


class LocalStage:
    """``cls(*args, **kwargs)`` in this process, with a handle's calling convention. Only the
    stage's async methods are callable (all a handle's callers use). ``cls``: the class, or
    ``"module:name"`` of it or of its Serve deployment (what a deployment's stage must use)."""

    def __init__(self, cls: type | str, *args: Any, **kwargs: Any) -> None:
        self._target, self._args, self._kwargs = cls, args, kwargs
        self._instance: Any = None

    async def start(self) -> LocalStage:
        """Build the instance (loads the stage's models: seconds), awaiting its ``__init__``
        when that is ``async def`` (as Serve allows). Idempotent."""
        if self._instance is None:
            cls = self._class()
            instance = cls.__new__(cls)
            built = instance.__init__(*self._args, **self._kwargs)
            if inspect.isawaitable(built):
                await built
            self._instance = instance
        return self

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        if self._instance is None:
            raise RuntimeError(f"{self._target!r} is not started in this process")
        return _Method(self._instance, name)

    def __getstate__(self) -> dict[str, Any]:
        # The import path (or class) and the arguments travel; an instance (models, threads) never does.
        return {"_target": self._target, "_args": self._args, "_kwargs": self._kwargs, "_instance": None}

    def _class(self) -> type:
        """The class: given, or ``module:name`` imported here (a Serve deployment's class)."""
        if not isinstance(self._target, str):
            return self._target
        module, _, name = self._target.partition(":")
        found = getattr(importlib.import_module(module), name)
        return getattr(found, "func_or_class", found)


async def started(stage: Any) -> Any:
    """A ``LocalStage`` built in this process; a deployment handle (or None) as it is."""
    return await stage.start() if isinstance(stage, LocalStage) else stage
