"""The tensor memory a running program holds, counted as it runs (``run(..., observer)`` with
``observer.track_memory``).

``run`` keeps its values in two dicts: ``env`` (node -> tuple of outputs) and ``copies``
(node -> {(index, layout): piece}). Run with tracking, they are ``LiveEnv`` / ``LiveCopies``,
which count every tensor storage they reference (by its data pointer, so views and the
several names of one storage count once) and keep the largest total: the distinct storage
bytes the program held at its peak, which is what the planner's memory model estimates
(``Plan.peak_memory_bytes``). Buffers an op allocates for itself while it runs, and the
allocator's caching, are not seen; an accelerator's allocator reports those
(``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor


class Counter:
    """Storages referenced by the program's values: reference counts and bytes."""

    __slots__ = ("refs", "size", "total", "peak")

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.total = 0
        self.peak = 0

    def add(self, values: Iterable[Any]) -> None:
        for t in values:
            if isinstance(t, Tensor):
                s = t.untyped_storage()
                key = s.data_ptr()
                n = self.refs.get(key, 0)
                if n == 0:
                    size = s.nbytes()
                    self.size[key] = size
                    self.total += size
                self.refs[key] = n + 1
        if self.total > self.peak:
            self.peak = self.total

    def remove(self, values: Iterable[Any]) -> None:
        for t in values:
            if isinstance(t, Tensor):
                key = t.untyped_storage().data_ptr()
                n = self.refs.get(key, 0)
                if n <= 1:
                    self.refs.pop(key, None)
                    self.total -= self.size.pop(key, 0)
                else:
                    self.refs[key] = n - 1


class _Counted(dict):
    """A dict that counts the tensors its values hold in ``counter``; ``_tensors`` says which
    those are for one value."""

    __slots__ = ("counter",)

    def __init__(self, counter: Counter) -> None:
        super().__init__()
        self.counter = counter

    @staticmethod
    def _tensors(value: Any) -> Iterable[Any]:
        raise NotImplementedError

    def __setitem__(self, key: Any, value: Any) -> None:
        old = dict.get(self, key)
        self.counter.add(self._tensors(value))  # before the old ones go: a shared storage stays
        if old is not None:
            self.counter.remove(self._tensors(old))
        dict.__setitem__(self, key, value)

    def pop(self, key: Any, *default: Any) -> Any:
        if key in self:
            value = dict.pop(self, key)
            self.counter.remove(self._tensors(value))
            return value
        return dict.pop(self, key, *default)

    def release(self) -> None:
        """Forget every value (a program's run ended: what it returns, its caller holds)."""
        for value in dict.values(self):
            self.counter.remove(self._tensors(value))
        dict.clear(self)


class LiveEnv(_Counted):
    """``run``'s ``env`` (node -> tuple of values), counting what it holds."""

    __slots__ = ()

    @staticmethod
    def _tensors(value: tuple) -> Iterable[Any]:
        return value


class _LiveLayouts(_Counted):
    """One node's copies ((index, layout) -> piece)."""

    __slots__ = ()

    @staticmethod
    def _tensors(value: Any) -> Iterable[Any]:
        return (value,)


class LiveCopies(_Counted):
    """``run``'s ``copies`` (node -> {(index, layout): piece}), counting what it holds; a
    node's entry is made by ``setdefault``, as ``run`` makes it."""

    __slots__ = ()

    @staticmethod
    def _tensors(value: dict) -> Iterable[Any]:
        return value.values()

    def setdefault(self, key: str, default: Any = None) -> Any:
        have = dict.get(self, key)
        if have is None:
            have = _LiveLayouts(self.counter)
            dict.__setitem__(self, key, have)
        return have


__all__ = ["Counter", "LiveCopies", "LiveEnv"]
