"""aotc: ahead-of-time compilation of PyTorch LLM inference graphs.

The public API for models: `entry` marks a method as a compiled entry,
`register_architecture` maps config.json to a model class, `CausalLM` is the
base class of models, `Derived` gives compiled graphs weights in another layout
than the checkpoint's, read by a module's `compiled_forward` (aotc.layout); see
docs/models.md, "Bring your own model".

The public API for running a bundle: `Session.open(bundle)`, then
`session.generate(prompts)` (Completions; `stream=True`: TokenEvents; `sampling=
SamplingParams(...)`, `stop=[...]`); `session.service()` takes requests from
threads and asyncio tasks as a server does (`Service.submit` returns a `Handle`); see
docs/python-api.md and docs/engine.md.
"""

__version__ = "0.1.0"

from .entry import entry  # noqa: E402
from .errors import AotcError  # noqa: E402
from .layout import Derived  # noqa: E402
from .models.base import SCRATCH_SLOT, CausalLM  # noqa: E402
from .models.config import ModelConfig  # noqa: E402
from .models.registry import register_architecture  # noqa: E402
from .runtime.completion import Completion, TokenEvent  # noqa: E402
from .runtime.sampling import SamplingParams  # noqa: E402
from .runtime.service import Handle, QueueFull, Service  # noqa: E402
from .runtime.session import Session  # noqa: E402

__all__ = [
    "AotcError",
    "CausalLM",
    "Completion",
    "Derived",
    "Handle",
    "ModelConfig",
    "QueueFull",
    "SCRATCH_SLOT",
    "SamplingParams",
    "Service",
    "Session",
    "TokenEvent",
    "entry",
    "register_architecture",
    "__version__",
]
