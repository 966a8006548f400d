"""DeepSeek V4's mixture of experts: the experts, the gate (hash or scored routing), and the MoE layer, whole or across ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ... import parallel
from ...layout import Derived
from .config import DeepseekV4Config


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int, limit: float, dtype):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.w2 = nn.Linear(inter, hidden, bias=False, dtype=dtype)
        self.w3 = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.limit = limit

    def forward(self, x):
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class Gate(nn.Module):
    def __init__(self, c: DeepseekV4Config, hashed: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c.n_routed_experts, c.hidden_size, dtype=c.dtype))
        if hashed:  # token id -> experts, fixed in the checkpoint
            self.register_buffer("tid2eid", torch.zeros(c.vocab_size, c.num_experts_per_tok, dtype=torch.long))
        else:  # added to the scores for the choice only
            self.bias = nn.Parameter(torch.zeros(c.n_routed_experts, dtype=torch.float32))
        self.hashed, self.topk, self.scoring, self.scaling = hashed, c.num_experts_per_tok, c.scoring_func, c.routed_scaling_factor

    def forward(self, x, ids):
        logits = F.linear(x, self.weight)
        if self.scoring == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.scoring == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        if self.hashed:
            chosen = self.tid2eid[ids]
        else:
            chosen = torch.topk(scores + self.bias, self.topk, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        return chosen, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling


class MoE(nn.Module):
    """The router, the routed experts and the shared expert. At expert-parallel degree N
    (--expert-parallel) this rank holds experts [rank*E/N, (rank+1)*E/N) as its experts
    0..E/N-1, and `expert_map` (a weight: each rank's own values, one graph for all)
    takes the router's choices to them: E/N where another rank holds the expert. Each
    rank computes its experts' part of every row, and one fp32 all-reduce sums the parts.

    With data-parallel attention (--data-parallel-attention) each rank's rows are its own
    sequences' tokens: one all-gather brings every rank's rows (with their token ids packed
    in, for hash routing), every rank routes them all alike, runs its experts on them, and
    one fp32 reduce-scatter sums the parts and hands each rank its own rows' sums."""

    def __init__(self, c: DeepseekV4Config, hashed: bool):
        super().__init__()
        self.gate = Gate(c, hashed)
        ways = c.parallel.expert_parallel
        n = c.n_routed_experts // ways
        self.experts = nn.ModuleList(Expert(c.hidden_size, c.moe_intermediate_size, c.swiglu_limit, c.dtype) for _ in range(n))
        self.shared_experts = Expert(c.hidden_size, c.moe_intermediate_size, c.swiglu_limit, c.dtype)
        self.group, self.first = (parallel.group_name(c.parallel), c.rank * n) if ways > 1 else (None, 0)
        self.data_parallel = ways > 1 and parallel.data_parallel(c.parallel)
        self.by_all_reduce = self.data_parallel and c.parallel.gather == "all-reduce"
        if self.group is not None:
            # int64, as the hash tables: an xla module narrows int64 to int32 without JAX's x64 mode,
            # and its signature check reads every int32 input as that narrowed int64.
            self.register_buffer("expert_map", torch.empty(c.n_routed_experts, dtype=torch.long), persistent=False)

    def init_map(self) -> None:
        if self.group is not None:
            n = len(self.experts)
            self.expert_map = torch.full(self.expert_map.shape, n, dtype=torch.long)
            self.expert_map[self.first : self.first + n] = torch.arange(n)

    def local(self, chosen, weights):
        """The router's choices as this rank's experts (E/N: another rank's), and their
        weights, 0 for another rank's."""
        local = self.expert_map[chosen]
        return local, weights * (local < len(self.experts))

    def derived_weights(self):
        # Compiled graphs take the experts stacked, [E, out, in], so that a decode step
        # can index the chosen experts' matrices and read no others.
        n = len(self.experts)
        return {f"stacked_{w}": Derived("stack", tuple(f"experts.{e}.{w}.weight" for e in range(n))) for w in ("w1", "w2", "w3")}

    def forward(self, x, ids):
        """Each expert once, on the tokens routed to it (a loop over the experts)."""
        if self.data_parallel:
            every, every_ids = self.gather(x, ids)
            chosen, weights = self.gate(every, every_ids)
            partial = self.each_expert(every, *self.local(chosen, weights), dtype=torch.float32)
            return self.scatter(partial).to(x.dtype) + self.shared_experts(x)
        chosen, weights = self.gate(x, ids)  # [N, k]
        if self.group is None:
            return self.each_expert(x, chosen, weights) + self.shared_experts(x)
        partial = self.each_expert(x, *self.local(chosen, weights), dtype=torch.float32)
        return parallel.all_reduce(partial, self.group).to(x.dtype) + self.shared_experts(x)

    def rank(self):
        """This rank's index, [1], from its expert map (a weight: one graph for every rank):
        the block of the map that holds its own experts."""
        n = len(self.experts)
        return ((self.expert_map < n).long().argmax() // n).view(1)

    def gather(self, x, ids):
        """Every rank's rows [ranks*N, H], in rank order, and their token ids where the router
        hashes them: one all-gather, the ids packed into the rows as int32 bits (a copy moves
        bits unchanged; a vocabulary fits in 31 bits). Gathered by all-reduce (the layout's
        gather), the ids go as float32 values, exact below 2**24, since a sum moves values,
        not bits."""
        h = x.shape[1]
        if self.by_all_reduce:
            rows = x if not self.gate.hashed else torch.cat([x.float(), ids.float()[:, None]], dim=1)
            every = parallel.all_gather_rows(rows, self.group, self.rank())
            return (every, None) if not self.gate.hashed else (every[:, :h].to(x.dtype), every[:, h].long())
        if not self.gate.hashed:
            return parallel.all_gather(x, 0, self.group), None
        packed = ids.to(torch.int32)[:, None].view(x.dtype)  # [N, 4 / itemsize]
        every = parallel.all_gather(torch.cat([x, packed], dim=1), 0, self.group)
        return every[:, :h], every[:, h:].contiguous().view(torch.int32)[:, 0].long()

    def scatter(self, partial):
        """Each rank's own rows of the sum of every rank's fp32 parts."""
        return parallel.reduce_scatter(partial, self.group, self.rank() if self.by_all_reduce else None)

    def compiled_forward(self, x, ids, derived):
        """Each token's chosen experts gathered from the stacked weights, where a step makes fewer choices than there are experts; else the loop over the experts.

        Across ranks: the rank's experts densely on every row where the choices reach their
        number, else gathered; then one fp32 all-reduce of the parts (with data-parallel
        attention: on every rank's rows, gathered, and one fp32 reduce-scatter)."""
        n = len(self.experts)
        if self.data_parallel:
            every, every_ids = self.gather(x, ids)
            return self.scatter(self.routed(every, every_ids, derived)).to(x.dtype) + self.shared_experts(x)
        chosen, weights = self.gate(x, ids)  # [N, k]
        if self.group is None:
            if chosen.numel() < n:
                out = self.gathered(x, chosen, weights, derived)
            else:  # as many choices as experts: reading every expert once is the least
                out = self.each_expert(x, chosen, weights)
            return out + self.shared_experts(x)
        return parallel.all_reduce(self.routed(x, ids, derived), self.group).to(x.dtype) + self.shared_experts(x)

    def routed(self, x, ids, derived):
        """This rank's experts' fp32 part of each row: densely where the rows' choices reach
        the rank's expert count, else gathered (another rank's choice reads expert n-1 with
        weight 0)."""
        n = len(self.experts)
        chosen, weights = self.gate(x, ids)  # [N, k]
        local, weights = self.local(chosen, weights)
        if chosen.numel() < n:
            return self.gathered(x, local.clamp(max=n - 1), weights, derived, torch.float32)
        return self.dense(x, local, weights, derived)  # static shapes on every backend: each of the rank's experts once, on every row

    def dense(self, x, local, weights, stacked):
        """The rank's experts on every row, each row weighted by its weight for the expert
        (the sum over its slots that chose it; 0 where none did), summed in fp32."""
        limit, n = self.experts[0].limit, len(self.experts)
        per_expert = (weights[..., None] * (local[..., None] == torch.arange(n, device=x.device))).sum(1)  # [N, n]
        gate = torch.einsum("nh,eih->eni", x, stacked["stacked_w1"]).clamp(max=limit)
        up = torch.einsum("nh,eih->eni", x, stacked["stacked_w3"]).clamp(min=-limit, max=limit)
        h = F.silu(gate) * up * per_expert.t()[..., None].to(up.dtype)
        return torch.einsum("eni,ehi->nh", h, stacked["stacked_w2"]).float()

    def each_expert(self, x, chosen, weights, dtype=None):
        """Each expert once on the tokens routed to it, each token once per expert: a token
        whose picks name one expert in several slots (a hash-routing table may) gets it
        weighted by the sum of those slots' weights, what transformers' sum over (token,
        slot) pairs gives."""
        out = torch.zeros_like(x, dtype=dtype)
        for e, expert in enumerate(self.experts):
            picked = chosen == e  # [N, k]
            (rows,) = picked.any(dim=-1).nonzero(as_tuple=True)  # the tokens routed to expert e
            torch._check(rows.shape[0] <= x.shape[0])  # one row per token, whatever the picks: the static bound
            w = (weights * picked).sum(dim=-1)  # [N]: the weight of expert e for each token
            out.index_add_(0, rows, (expert(x[rows]) * w[rows, None]).to(out.dtype))
        return out

    def gathered(self, x, chosen, weights, stacked, dtype=None):
        """The experts' SwiGLU on each token's chosen experts only. Written as multiply
        and sum over the indexed matrices: Inductor fuses the indexing into the
        reduction, so each chosen matrix is read once and none is copied."""
        limit = self.experts[0].limit
        xe = x[:, None, None, :]  # [N, 1, 1, H]
        gate = (xe * stacked["stacked_w1"][chosen]).sum(-1).clamp(max=limit)  # [N, k, I]
        up = (xe * stacked["stacked_w3"][chosen]).sum(-1).clamp(min=-limit, max=limit)
        h = F.silu(gate) * up * weights[..., None]
        return (h[:, :, None, :] * stacked["stacked_w2"][chosen]).sum((1, 3)).to(dtype or x.dtype)
