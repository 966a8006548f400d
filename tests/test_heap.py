"""aotc.heap: the cyclic collector paused while a graph is traced, saved or rebuilt."""

from __future__ import annotations

import gc
import threading

import torch

from aotc import heap


def test_the_collector_is_off_inside_and_back_as_it_was_after():
    assert gc.isenabled()
    with heap.paused():
        assert not gc.isenabled()
        with heap.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()  # a program that runs with the collector off keeps it off
    try:
        with heap.paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_collector_resumes_when_the_last_thread_inside_leaves():
    inside, leave = threading.Event(), threading.Event()

    def other():
        with heap.paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    with heap.paused():
        t.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread is still inside
    leave.set()
    t.join(10)
    assert gc.isenabled()


def test_tracing_saving_and_rebuilding_a_graph_run_with_the_collector_paused(tiny_dir, monkeypatch):
    import io

    from aotc.backends import export
    from aotc.models.loader import load_model
    from aotc.trace import Shapes, find_variants, trace

    seen = []
    for name in ("export", "save", "load"):
        real = getattr(torch.export, name)
        monkeypatch.setattr(torch.export, name, lambda *a, real=real, name=name, **k: seen.append((name, gc.isenabled())) or real(*a, **k))
    model = load_model(tiny_dir, weights=False).model
    shapes = Shapes.of(model, 2, 64)
    head = next(v for v in find_variants(model, shapes) if v.entry_id == "LMHead.forward")
    program = trace(head, 1, shapes).program
    buf = io.BytesIO()
    export.save_program(program, buf, [])
    export.load_program(buf.getvalue())
    assert seen == [("export", False), ("save", False), ("load", False)] and gc.isenabled()
