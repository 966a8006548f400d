"""Prefill chunks that hold several sequences.

A prefill chunk's rows are the tokens of one or more sequences, packed one after
another: row i is position positions[i] of the sequence in cache slot slots[i]. The
first row's sequence may continue one whose earlier positions the cache holds (a
prompt longer than a chunk, which the dispatcher cuts into consecutive calls); every
other sequence starts in the chunk, at position 0. So a row attends to the cache
positions of its sequence before the chunk (the first sequence's only) and to the
chunk's own rows of its sequence up to its position: a chunk of C rows reads one
slot's cache and C rows more, however many sequences it holds.

A chunk whose first row is at position 0 is *fresh*: every sequence in it starts
there, and it reads its own C rows only. The prefill entry has a second form for it
(`fresh=` on aotc.entry, LlamaDecoderLayer.prefill_fresh) that the runtime runs in
its place: SmolLM2's four 38-token chat prompts, one chunk of 160 at context 160,
attended over 320 keys a row in the general form, 160 in the fresh one.

A long chunk's query rows attend in tiles (`attend_in_tiles`): a row reads no later row
of the chunk, so a tile of rows reads the keys up to its own last row only. A fresh
chunk of 512 reads a little over half its 512 x 512 scores (the mask dropped the rest
anyway).

Rows of several sequences in one chunk graph, rather than chunk graphs with a batch
dimension: a batch of short prompts (chat turns) fills one chunk bucket instead of
padding each prompt to its own chunk, and the build gains no graph per (batch,
chunk) pair.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kvcache import load


@dataclass
class Packed:
    ids: torch.Tensor  # [N] the prompts' tokens, one after another
    positions: torch.Tensor  # [N] each token's position in its sequence
    slots: torch.Tensor  # [N] each token's cache slot
    last: torch.Tensor  # [n] the row of each prompt's last token


def pack(prompts: list[torch.Tensor], slots: list[int], start: int = 0) -> Packed:
    """Prompts for the sequences in `slots`, as one prefill's rows: the first from position
    `start` (it continues what the cache holds), every other from position 0."""
    device = prompts[0].device
    lengths = torch.tensor([p.shape[0] for p in prompts], device=device)
    rows = torch.arange(int(lengths.sum()), device=device)
    starts = torch.cumsum(lengths, 0) - lengths
    positions = rows - starts.repeat_interleave(lengths)
    if start:
        positions[: prompts[0].shape[0]] += start
    return Packed(
        ids=torch.cat(prompts),
        positions=positions,
        slots=torch.tensor(slots, device=device).repeat_interleave(lengths),
        last=starts + lengths - 1,
    )


def packed_rows(rows, cache, slots: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, fresh: bool = False) -> torch.Tensor:
    """[kv heads, cached + C, head dim]: the keys (or values) a packed chunk attends to, as
    packed_bias orders them: the first row's sequence's cached positions, then the
    chunk's own rows as the cache holds them (written by this chunk). A `fresh` chunk
    (its first row at position 0, so every sequence starts in it) reads its own rows
    only: [kv heads, C, head dim]. rows, cache: as aotc.kvcache.load takes them."""
    own = load(rows, cache, (slots, slice(None), positions), dtype).transpose(0, 1)
    if fresh:
        return own
    return torch.cat([load(rows, cache, (slots[:1],), dtype)[0], own], dim=1)


# Rows of a query tile (attend_in_tiles). bench/causal_tiles.py, SmolLM2-135M's heads, 30
# layers, fp32, a fresh chunk: tiles of 64 take 0.88x the untiled time at 160 rows, 0.82x
# at 192, 0.73x at 256, 0.42x at 512. Tiles of 16 lose below 256 (more, smaller matmuls);
# tiles of 32 are 0.94x at 512 and 1.14x at 192.
TILE = 64


def attend_in_tiles(attend, q, keys, values, bias, cached: int, tile: int = TILE):
    """attend(q, keys, values, bias) for a packed chunk, its query rows in tiles of `tile`.

    q: [kv heads, rep, C, head dim], a KV head's query heads and the chunk's rows;
    keys, values: [kv heads, cached + C, head dim] (packed_rows); bias: [C, cached + C]
    (packed_bias). Returns [kv heads, rep, C, head dim]. A row of the chunk attends to no
    later row (a sequence's rows come in order), so the tile of rows [a, b) reads keys up
    to cached + b only: the rest of its scores are masked. (Padding rows, which see each
    other, see only the padding rows up to their tile's end: their outputs are dropped.)
    A chunk of at most two tiles is one call: the smaller matmuls would cost more than the
    masked scores they skip."""
    kv, rep, c, hd = q.shape
    tiles = [(a, min(a + tile, c)) for a in range(0, c, tile)] if c > 2 * tile else [(0, c)]
    out = []
    for a, b in tiles:
        n = cached + b
        # A KV head's query heads and rows as the rows of one matmul against its keys: a
        # broadcast over the query heads would copy the keys once per query head.
        rows = q[:, :, a:b].reshape(kv, rep * (b - a), hd)
        out.append(attend(rows, keys[:, :n], values[:, :n], bias[a:b, :n].repeat(rep, 1)).view(kv, rep, b - a, hd))
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


def packed_bias(positions: torch.Tensor, slots: torch.Tensor, cached: int, window: int | None = None) -> torch.Tensor:
    """[C, cached + C] float32, added to the scores: 0 at the keys each row of a packed
    chunk attends to, -inf elsewhere. First the cache's `cached` positions of the first
    row's sequence (those before the chunk; none for a fresh chunk, cached 0), then the
    chunk's rows (those of the row's own sequence, up to its position). Padding rows
    (the scratch slot, position 0) see each other only.

    A bias, made part by part, and not a bool mask: a compiled graph keeps the mask in
    memory as floats. Inductor's CPU softmax kernel over a bool mask loaded from memory
    is slow: SmolLM2 bf16, a chunk of 128 at context 1024, 3.5 ms a layer, 1.5 ms with
    this bias; a masked softmax over [3, 384, 1152] scores alone, 5.2 ms against 0.81."""
    parts = _visible_parts(positions, slots, cached, window)
    return torch.cat([torch.where(part, 0.0, float("-inf")) for part in (parts if cached else parts[1:])], dim=1)


def _visible_parts(positions, slots, cached: int, window: int | None):
    q_pos = positions[:, None]  # [C, 1]
    k_pos = torch.arange(cached, device=positions.device)[None, :]
    earlier = (k_pos < positions[:1]) & (slots == slots[:1])[:, None]
    own = (slots[:, None] == slots[None, :]) & (positions[None, :] <= q_pos)
    if window is not None:
        earlier = earlier & (k_pos > q_pos - window)
        own = own & (positions[None, :] > q_pos - window)
    return earlier, own
