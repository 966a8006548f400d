"""`python -m aotc`: the CLI (how aotc run starts the ranks of a parallel bundle)."""

from .cli import main

main()
