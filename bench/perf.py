"""aotc against what a user would pick instead, side by side in one run.

    python bench/perf.py [--sections decode,lowp,...] [--quick] [--peers] [--out bench/results/perf.json]

Each section is a module of bench/sections and runs alone (`--sections lowp` needs no
other to have run); --help lists them. Their results go into one JSON file, each with
what ran it ("ran": the machine's cores, torch, the CPU flags that decide which number
formats have arithmetic of their own; --quick, --backend, the start time).

--quick runs the tiny models only, with fewer repeats, tokens and layer counts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import OPTIONAL, Run, console, load_sections, machine  # noqa: E402
from llamacpp import DEFAULT_CACHE  # noqa: E402

from aotc.format import encode, write_atomic  # noqa: E402
from aotc.terminal import print_whole_when_piped  # noqa: E402


def main() -> None:
    sections = load_sections()
    default = [name for name in sections if name not in OPTIONAL]
    listing = "\n".join(textwrap.indent(textwrap.dedent(sys.modules[fn.__module__].__doc__).strip(), "  ") for fn in sections.values())
    ap = argparse.ArgumentParser(description=__doc__, epilog="sections:\n" + listing, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny models only, fewer repeats, tokens and layer counts")
    ap.add_argument("--sections", default=",".join(default), help=f"comma-separated, of {', '.join(sections)} (default: all but {', '.join(sorted(OPTIONAL))})")
    ap.add_argument("--backend", default="inductor", help="the aotc backend the sections build and time (default inductor; decode also times export, resident xla)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "perf.json")
    ap.add_argument("--peers", action="store_true", help=f"also run the sections against llama.cpp ({', '.join(sorted(OPTIONAL))}): it is built once into --peers-cache")
    ap.add_argument("--peers-cache", type=Path, default=DEFAULT_CACHE, help=f"where llama.cpp is built and aiperf installed, once per version and CPU (default {DEFAULT_CACHE})")
    args = ap.parse_args()
    chosen = list(dict.fromkeys(args.sections.split(",") + (sorted(OPTIONAL) if args.peers else [])))
    unknown = [s for s in chosen if s not in sections]
    if unknown:
        ap.error(f"--sections: unknown {', '.join(unknown)}; expected some of {', '.join(sections)}")
    print_whole_when_piped(console)
    # Sections run now replace theirs in an existing results file; the others are kept,
    # each with what ran it.
    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    ran = {"machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": args.quick, "backend": args.backend}
    with tempfile.TemporaryDirectory(prefix="aotc-bench-") as tmp:
        root = Path(tmp)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor-cache"))
        run = Run(root, quick=args.quick, peers_cache=args.peers_cache, backend=args.backend)
        for name in chosen:
            # The load average before says whether another process shared the cores.
            before = os.getloadavg()
            found = sections[name](run)
            load = {"before": before, "after": os.getloadavg()}
            results[name] = {**found, "ran": {**ran, "load average (1, 5, 15 min)": load, "ended": time.strftime("%Y-%m-%d %H:%M:%S")}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, encode(results))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
