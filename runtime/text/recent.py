"""A small map of the most recently used entries, safe from several threads: what a session keeps of its last
requests (compiled grammars, tokenized request texts, template pieces).

    kept = Recent(2); kept.put("a", 1); kept.put("b", 2); kept.get("a"); kept.put("c", 3)
    -> "b" is dropped (the least recently used); kept.get("a") == 1, kept.get("b") is None
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, Optional, TypeVar

V = TypeVar("V")


class Recent(Generic[V]):
    def __init__(self, size: int):
        self._size, self._items, self._lock = size, OrderedDict(), threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def get(self, key: Hashable) -> Optional[V]:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Hashable, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def get_or_make(self, key: Hashable, make: Callable[[], V]) -> V:
        """The kept value, or `make()`'s, kept (made outside the lock: a slow compile blocks no other reader)."""
        value = self.get(key)
        if value is None:
            value = make()
            self.put(key, value)
        return value
