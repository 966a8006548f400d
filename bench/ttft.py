"""One fresh process that produces the first token of one prompt, then exits.

    python bench/ttft.py aotc    BUNDLE MODEL_DIR N_TOKENS
    python bench/ttft.py compile MODEL_DIR N_TOKENS [BACKEND]  # torch.compile baseline (default inductor)
    python bench/ttft.py eager   MODEL_DIR N_TOKENS

Prints one JSON line: the mode, the token, and seconds from the start of this
script to the first token (the caller also times the whole process).
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))


def prompt(n: int) -> torch.Tensor:
    return torch.arange(3, 3 + n) % 500 + 3


def main() -> None:
    mode = sys.argv[1]
    from aotc.models.loader import load_model

    if mode == "aotc":
        from aotc.runtime import Bundle

        bundle = Bundle.load(sys.argv[2])
        loaded = load_model(sys.argv[3])
        bundle.bind(loaded.model)
        caches = loaded.model.allocate_caches(bundle.cache_slots, bundle.max_seq)
        logits = loaded.model.prefill(prompt(int(sys.argv[4])), 0, caches)
    elif mode == "eager":
        loaded = load_model(sys.argv[2])
        n = int(sys.argv[3])
        caches = loaded.model.allocate_caches(2, n + 1)
        logits = loaded.model.prefill(prompt(n), 0, caches)
    elif mode == "compile":
        from gptfast import from_aotc

        loaded = load_model(sys.argv[2])
        n = int(sys.argv[3])
        model = from_aotc(loaded.model)
        model.setup_caches(1, n + 1)
        backend = sys.argv[4] if len(sys.argv) > 4 else "inductor"
        step = torch.compile(model, fullgraph=True, dynamic=False, backend=backend)
        with torch.no_grad():
            logits = step(prompt(n)[None], torch.arange(n))[0, -1]
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    token = int(logits.argmax())
    print(json.dumps({"mode": mode, "token": token, "seconds": time.perf_counter() - T0}))


if __name__ == "__main__":
    main()
