"""Any dense decoder-only model in transformers, from transformers' own modeling code.

transformers supplies the weight names, the embeddings, rotary, norms and the
layers; aotc supplies the caches, buckets, passes, backends and runtime. The
model's own `*ForCausalLM.forward` runs eagerly around its decoder layers and
LM head, which are entries, so one compiled graph serves every layer of a
class (a variant of it, where layers differ: sliding or full, NoPE, a scale):

- **Layers.** Each decoder layer (the model's `_no_split_modules`) becomes an
  instance of a generated subclass of its own class, whose `decode` and
  `prefill` entries call the class's own `forward` with a stand-in cache
  (`_LayerCache`): its `update` is one indexed write per cache into the
  layer's cache input (aotc.kvcache, so fp8 caches, context buckets and the
  passes work as for aotc's own models), and returns the rows the layer's
  queries see. The subclass's `forward` is what the model's loop calls: it
  takes the hidden state and rotary (cos, sin) the model computed and hands
  them, with positions, slots and the layer's caches, to the entry.
- **Attention.** The "aotc" function of transformers' AttentionInterface
  (`_attention`) masks by the positions the entry passes through the layer's
  kwargs (`aotc_positions`), and the window, softcap and sinks the attention
  module passes it; transformers builds no mask for it.
- **`layer_idx`** reads as a `_LayerIndex`, which the stand-in cache ignores
  and anything else refuses, so that no layer's graph bakes in its index; a
  module's `config` groups layers by the hash of its JSON.
- **The contract** (what each layer's call passes, the shapes its attention
  writes to the cache) is learnt from one forward of the model on meta or
  fake tensors, when the model is built (`_learn`); nothing is written per
  architecture.
- **The head.** The LM head, an `nn.Linear`, becomes an entry too (`project`);
  the final norm, a softcap or a logits scale stay in the model's forward.
- **Experts.** MoE experts that use transformers' ExpertsInterface run the
  "aotc" experts function eagerly (each chosen expert on its tokens) and, in
  graphs, a compiled form (`_experts_class`): each token's chosen experts
  gathered from the fused weights at decode, every expert on its tokens at
  prefill. Checkpoints that keep one tensor per expert are merged into the
  fused parameters as transformers' conversion mapping says
  (`checkpoint_layout`).
- **Refusals.** What the path cannot take (recurrent or convolution state,
  chunked attention, KV shared across layers, masks other than causal and
  sliding, encoder-decoders, a cache asked for more than `update`) is refused
  from the config or the contract learning run, before anything is traced.
"""

from .config import NAME, TransformersConfig, installed, knows
from .contract import LMHead
from .model import TransformersCausalLM, code_identity

__all__ = ["NAME", "LMHead", "TransformersCausalLM", "TransformersConfig", "code_identity", "installed", "knows"]
