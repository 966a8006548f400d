"""Prefix caching: which cache slots hold which token prefixes, so that a prompt that
starts like an earlier one skips the shared part of its prefill (runtime.engine).

A cache slot's first positions hold exactly the keys and values of its sequence's first
tokens: `held[slot]` is that token list, as far as the graphs have written it (a prompt as
it is prefilled; a finished sequence's prompt and every chosen token but the last, which
no step fed back). Full blocks of BLOCK tokens are indexed by chained hashes (a block's
hash covers every token before it, as vLLM's block hashes do), so finding the slot with
the longest shared prefix is one dict lookup per block, not a scan of every slot. A hash
only points: the match is the tokens' own common prefix with what the slot holds, which
also takes the tokens past the last full block.

Slots whose requests finished keep what they hold until the engine hands them out again;
it hands out the free slot that holds no block first, then the one used least recently.
"""

from __future__ import annotations

import itertools

BLOCK = 16  # tokens per indexed block (vLLM's default block size)


class PrefixIndex:
    """What each of `slots` cache slots holds (the engine's request slots), indexed by block."""

    def __init__(self, slots: int, block: int = BLOCK):
        self.block = block
        self.held: list[list[int]] = [[] for _ in range(slots)]
        self.hashes: list[list[int]] = [[] for _ in range(slots)]  # per slot, its full blocks' chained hashes
        self.slots_of: dict[int, set[int]] = {}  # a chained block hash -> the slots holding that chain
        self.used = [0] * slots  # the clock when each slot was last released or copied from
        self._clock = itertools.count(1)

    def chain(self, tokens: list[int], start: int = 0, parent: int = 0) -> list[int]:
        """The chained hashes of tokens' full blocks from block `start` on (parent: block
        start - 1's). Hashes of ints are the same in every process (None's is its address,
        before Python 3.12): tensor-parallel ranks, each with an engine, decide alike."""
        out, b = [], self.block
        for i in range(start, len(tokens) // b):
            parent = hash((parent, tuple(tokens[i * b : (i + 1) * b])))
            out.append(parent)
        return out

    def lookup(self, tokens: list[int]) -> tuple[int | None, int]:
        """(slot, n): the slot that holds the longest prefix of tokens that runs through at
        least one full block, and how many tokens of it, at most len(tokens) - 1 (the last
        prompt token is always computed: its logits choose the first new token). (None, 0)
        where no slot holds a full block of it."""
        found = None
        for h in self.chain(tokens):
            slots = self.slots_of.get(h)
            if not slots:
                break
            found = slots
        if found is None:
            return None, 0
        best, n = None, 0
        for slot in sorted(found):
            held = self.held[slot]
            m = 0
            for a, b in zip(held, tokens):  # the tokens themselves: a hash collision matches nothing
                if a != b:
                    break
                m += 1
            if m > n:
                best, n = slot, m
        return (best, min(n, len(tokens) - 1)) if n >= self.block else (None, 0)

    def hold(self, slot: int, tokens: list[int]) -> None:
        """Slot `slot` now holds exactly `tokens` at its first positions: a prefix of what it
        held (the rest will be overwritten), or what it held extended by the positions the
        graphs have just written."""
        held, hashes = self.held[slot], self.hashes[slot]
        keep = 0  # the leading blocks that stay as they were
        for i in range(min(len(hashes), len(tokens) // self.block)):
            if held[i * self.block : (i + 1) * self.block] != tokens[i * self.block : (i + 1) * self.block]:
                break
            keep = i + 1
        for h in hashes[keep:]:
            self._drop(h, slot)
        del hashes[keep:]
        for h in self.chain(tokens, keep, hashes[-1] if hashes else 0):
            hashes.append(h)
            self.slots_of.setdefault(h, set()).add(slot)
        self.held[slot] = list(tokens)

    def touch(self, slot: int) -> None:
        self.used[slot] = next(self._clock)

    def pick(self, free: list[int]) -> int:
        """Of the free slots, the one to hand out: one that holds no full block (the lowest),
        else the one used least recently."""
        return min(free, key=lambda s: (bool(self.hashes[s]), self.used[s] if self.hashes[s] else 0, s))

    def _drop(self, h: int, slot: int) -> None:
        slots = self.slots_of.get(h)
        if slots is not None:
            slots.discard(slot)
            if not slots:
                del self.slots_of[h]
