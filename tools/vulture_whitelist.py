"""What vulture (tests/test_dead_code.py, confidence 60) cannot see being used.

Made with `vulture aotc --min-confidence 60 --make-whitelist`, then pruned: each
name below is read by something outside vulture's view, said in its comment.
Anything else vulture reports is dead code: delete it, or wire it in.
"""

from vulture.whitelist_utils import Whitelist

_ = Whitelist()

# Registered by decorator and found through a registry, never by name.
ExportBackend  # @register_backend
InductorBackend  # @register_backend
DeepseekV4ForCausalLM  # @register_architecture
Qwen2ForCausalLM  # @register_architecture
MistralForCausalLM  # @register_architecture

# typer commands and the app's callback (--verbose): the decorator registers them.
_options
init_tiny
cache_key_command
cache_ls
cache_prune

# nn.Module.forward is called by Module.__call__.
_.forward

# An entry's fresh form, named by its general entry (@entry(fresh="prefill_fresh")): the
# runtime's dispatcher and the tracer find it by that name.
_.prefill_fresh

# The eager reference of a whole prompt's logits: the tests and benches compare against it.
_.prompt_logits

# Signal handler signature (signal.signal passes both).
frame
signum

# Record fields written to JSON (the manifest, the compile cache, `aotc run --json`) for readers.
_.served
served
aotc_version
created_with
matching_tokens
tokens
eager_new_ids
twin_new_ids
modified  # PassResult: what a pass's caller reads

# The table of which halved bytes are exact: aotc/fp8.py's documented claim, checked by the tests.
HALVE_EXACT

# Set on tokenizers' objects: read by the tokenizers library.
_.pre_tokenizer
_.decoder

# Swapping a module's class to record attribute reads (aotc/trace.py, _recording).
_.__class__

# What crosses a resident device's boundary, counted for bench/perf.py's resident section and
# the tests (aotc/backends/xla.py JaxDevice), and the caches' device buffers they inspect.
_.sent
_.received
buffers

# Bundle.wrap_steps: a profiler's hook, called by bench/sections/overhead.py and context.py.
_.wrap_steps

# Set on rich's Console objects, read by rich (aotc/terminal.py).
_.soft_wrap

# The generic path (aotc/models/hf/): what transformers reads of what aotc sets
# (config._attn_implementation and _experts_implementation, tensors' _is_hf_initialized flags, a module's layer_idx,
# the generated entries' __signature__, read by inspect), and the arguments its cache and
# attention interfaces pass, which aotc's stand-ins take and ignore.
_._attn_implementation
_._experts_implementation
_._is_hf_initialized
_.layer_idx
_.__signature__
layer_idx
dropout
other

# Read by jinja2 of the chat template's sandbox (aotc/chat.py): the binary operators it
# routes through call_binop, and what an unsafe attribute becomes.
_.intercepted_binops
_.unsafe_undefined

# hf.compat.Private.until: when aotc can stop using a private transformers name; read by
# people and by tests/test_transformers_compat.py, which prints it for a missing name.
_.until

# aotc.Session's results (aotc/runtime/session.py), read by users' programs and
# docs/python-api.md: why a completion ended, and a streamed token's id.
_.finish_reason
_.token_id

# aotc run's rank entry point, named as "aotc.cli.run:run_rank" to runtime/launch.py, which
# imports it by name in each rank's process.
_.run_rank
_.serve_rank  # aotc serve's, the same way

# The export archive's check for a backend plugin that loads aotc's export archives itself
# (tests/test_backend_seam.py's interpreter backend does); aotc's own export backend reads
# the check's results with read_archive.
_.check_archive

# Engine.abort: a request cancelled while it waits, prefills or decodes (tests/test_engine.py;
# a server's client that leaves).
_.abort

# uvicorn.Server.should_exit: uvicorn's main loop reads it; the drain sets it to end serving.
_.should_exit

# XLA's CompileOptions, set as attributes and read by its compiler (xla.ReplicaProgram:
# a parallel bundle's hlo.pb compiled for one replica per rank).
_.num_replicas
_.device_assignment

# torch's own decoder, kept on aotc's (backends/export.py) for the test that compares the two.
_.__wrapped__
