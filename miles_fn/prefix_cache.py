"""Prompt prefixes' keys and values kept across generate calls: an exact memo, not a source of bits.

A prefill cuts each prompt at its turn ends (generate.turn_bounds), a function of the prompt's own tokens,
and runs the pieces one after another. The keys and values up to a cut are then a pure function of
(weights, model and ops config, the tokens before the cut), so a call that finds them here computes the
same bits as one that runs them: the cache changes the speed of a call, never its samples, in any ops mode.
A chat template's system turn (20 of SmolLM2's 44 chat_arith tokens) or a multi-turn rollout's history is
then prefilled once per weights instead of once per call.

Entries are bound to the weights they came from by each tensor's identity (a weak reference) and
_version: a weight sync's new tensors, or a write in place (an optimizer step, copy_), makes them stale,
and they are dropped when next looked up. The caller owns the cache and passes it in explicitly
(launch's engines hold one each and clear it on update_weights and flush_cache); nothing here is global.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import optree
import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, Hkv, S, D]
MAX_WEIGHT_SETS = 4  # a speculative engine's target and draft, plus the sets a weight sync replaces


class PrefixCache:
    """At most `max_bytes` of prefix keys/values, least recently used dropped first (0 keeps nothing)."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"PrefixCache: max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0  # lookups answered
        self.hit_tokens = 0  # prompt tokens those lookups saved a forward of
        self.misses = 0
        self._entries: collections.OrderedDict[Hashable, tuple[KV, int]] = collections.OrderedDict()
        self._weights: list[tuple[int, list[tuple[Any, int]]]] = []  # (slot, [(weakref, _version)]), newest last
        self._next_slot = 0
        self._lock = threading.Lock()

    def longest(self, params: Any, tag: Hashable, tokens: Sequence[int], ends: Sequence[int]
                ) -> tuple[int, KV | None]:
        """(e, keys/values [1, ., e, .]) for the longest tokens[:e], e in `ends`, stored for these weights
        and `tag` (the model and ops configs); (0, None) when none is."""
        if not self.max_bytes or not ends:
            return 0, None
        with self._lock:
            slot = self._slot(params)
            for e in sorted(ends, reverse=True):
                key = (slot, tag, tuple(tokens[:e]))
                got = self._entries.get(key)
                if got is not None:
                    self._entries.move_to_end(key)
                    self.hits += 1
                    self.hit_tokens += e
                    return e, got[0]
            self.misses += 1
            return 0, None

    def store(self, params: Any, tag: Hashable, tokens: tuple[int, ...], kv: KV) -> None:
        """Keep a copy of kv (its first len(tokens) columns), unless it alone exceeds max_bytes."""
        n = len(tokens)
        size = sum(2 * k[:, :, :n].numel() * k.element_size() for k, _ in kv)
        if not self.max_bytes or size > self.max_bytes:
            return
        copy = [(k[:, :, :n].clone(), v[:, :, :n].clone()) for k, v in kv]
        with self._lock:
            key = (self._slot(params), tag, tokens)
            if key in self._entries:
                return
            self._entries[key] = (copy, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._weights.clear()
            self.bytes = 0

    def _drop(self, key: Hashable) -> None:
        self.bytes -= self._entries.pop(key)[1]

    def _slot(self, params: Any) -> int:
        """These weights' slot (under the lock): a new one when no held set is these very tensors unchanged,
        the stale sets' entries dropped."""
        leaves = [t for t in optree.tree_leaves(params) if isinstance(t, torch.Tensor)]
        for i in [i for i, (_, sig) in enumerate(self._weights) if sig[0][0]() is None][::-1]:
            self._forget(i)  # weights that no longer exist: their entries can never be asked for again
        for i, (slot, sig) in enumerate(self._weights):
            if len(sig) == len(leaves) and sig[0][0]() is leaves[0]:
                if all(r() is t and v == t._version for (r, v), t in zip(sig, leaves, strict=True)):
                    return slot
                self._forget(i)  # the same tensors, written in place: everything derived from them is stale
                break
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        self._weights.append((slot, [(weakref.ref(t), t._version) for t in leaves]))
        while len(self._weights) > MAX_WEIGHT_SETS:
            self._forget(0)
        return slot

    def _forget(self, i: int) -> None:
        slot = self._weights.pop(i)[0]
        for key in [k for k in self._entries if k[0] == slot]:
            self._drop(key)
