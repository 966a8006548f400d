"""`python -m aotc`: the CLI."""

from .cli import main

main()
