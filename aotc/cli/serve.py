"""`aotc serve`: a bundle behind the OpenAI API."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from ..errors import AotcError
from .common import PLUGIN, _fail, _options, app, console, err_console


@app.command(short_help="Serve a bundle over the OpenAI API (completions, chat, streaming).")
def serve(
    path: Path = typer.Argument(..., help="Bundle folder written by aotc build."),
    model: Optional[str] = typer.Option(None, "--model", help="Model folder or Hugging Face Hub id (ORG/NAME) with the weights (default: the one the bundle was built from)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit) of --model ORG/NAME."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (default: loopback only; 0.0.0.0 for every interface)."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="TCP port to listen on (0: any free one, printed)."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", help="The model name clients send (default: the bundle folder's name)."),
    api_key: list[str] = typer.Option(
        [],
        "--api-key",
        show_default=False,
        help="KEY: requests must send Authorization: Bearer KEY; repeat for several keys (default: none needed). /health and /metrics are open.",
    ),
    max_queue: int = typer.Option(64, "--max-queue", min=0, help="Requests that may wait while every cache slot is taken; one more gets 429 with Retry-After."),
    shutdown_timeout: float = typer.Option(
        30.0,
        "--shutdown-timeout",
        min=0.0,
        help="Seconds a SIGTERM lets running requests finish (new ones get 503); streams still running then end with an error event and the exit status is 1.",
    ),
    prefix_cache: bool = typer.Option(
        True,
        "--prefix-cache/--no-prefix-cache",
        help="Reuse what the cache slots hold of a new prompt's first tokens (a shared system prompt, a conversation's earlier turns): its prefill starts after them.",
    ),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, show_default=False, help="CPU threads per kernel (default: the CPUs that other processes leave free)."),
    expect_digest: Optional[str] = typer.Option(None, "--expect-digest", help="HEX: refuse the bundle unless its digest is this one."),
    plugin: list[str] = PLUGIN,
):
    """An OpenAI-compatible server over a bundle: /v1/completions and /v1/chat/completions
    (streaming or not, sampling, stop strings, usage), /v1/models, /tokenize, /detokenize,
    /health and /metrics (docs/serving.md). Requests batch continuously on the bundle's
    cache slots. SIGTERM drains: exit 0 once every running request has ended. A parallel
    bundle runs as its local ranks, started and watched here; rank 0 serves."""
    from ..format import read_manifest
    from ..parallel import joined_rank

    try:
        try:
            from ..server.run import serve as run_server
        except ImportError as e:
            raise AotcError(f"aotc serve needs the serve extra ({e.name} is missing): pip install 'aotc[serve]'") from None
        layout = read_manifest(path).parallel
        if layout.world_size > 1 and joined_rank() is None:  # start the ranks; rank 0 serves
            from ..runtime.launch import launch

            arguments = {n: v for n, v in locals().items() if n in SERVE_ARGUMENTS}
            code, why = launch("aotc.cli.serve:serve_rank", {**arguments, "path": str(path)}, layout.world_size, forward=True)
            if why:
                err_console.print(f"[red]error:[/] {escape(why)}; ended the other ranks", highlight=False)
            raise typer.Exit(code)
        from ..runtime.session import Session

        session = Session.open(path, model, revision=revision, threads=threads, expect_digest=expect_digest, plugins=plugin)
    except AotcError as e:
        _fail(e)
    if session.rank != 0:  # its service steps with rank 0's, until rank 0's closes
        session.service(prefix_cache=prefix_cache).close()
        session.close()
        raise typer.Exit(0)
    name = served_model_name or Path(path).resolve().name

    def ready(address: str) -> None:
        off = session._service.engine.prefix_off
        prefix = "on" if off is None else "off" if not prefix_cache else f"off: {off}"
        console.print(f"serving {name} on http://{address} (slots {session.bundle.capacity}, max_seq {session.bundle.max_seq}, prefix cache {prefix})", highlight=False)

    try:
        status = run_server(session, name=name, host=host, port=port, api_keys=api_key, max_queue=max_queue, shutdown_timeout=shutdown_timeout,
                            prefix_cache=prefix_cache, ready=ready)  # fmt: skip
    finally:
        session.close()
    raise typer.Exit(status)


SERVE_ARGUMENTS = ("model", "revision", "host", "port", "served_model_name", "api_key", "max_queue", "shutdown_timeout", "prefix_cache", "threads", "expect_digest", "plugin")


def serve_rank(**arguments) -> int:
    """One rank of `aotc serve` on a parallel bundle (the launcher's entry point): rank 0
    serves, the others step with it; the exit status."""
    import click

    _options(verbose=False)
    try:
        serve(**{**arguments, "path": Path(arguments["path"])})
    except (click.exceptions.Exit, typer.Exit) as e:  # typer's own Exit is no click Exit (typer 0.20+)
        return e.exit_code
    return 0
