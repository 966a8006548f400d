"""The export archive checker: what aotc's export backend writes is accepted, and each
thing torch's loader would unpickle, resolve or evaluate is refused by name."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch

from aotc.backends.export import save_program
from aotc.backends.export_archive import check_archive, read_archive
from aotc.errors import BundleError


class Step(torch.nn.Module):
    """A graph as aotc's are: every weight an input."""

    def forward(self, x, w, cache, slots):
        return torch.nn.functional.linear(x, w) + cache[slots].sum()


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    path = tmp_path_factory.mktemp("archive") / "program.pt2"
    args = (torch.randn(2, 4), torch.randn(3, 4), torch.zeros(5, 4), torch.tensor([0, 1]))
    save_program(torch.export.export(Step(), args, strict=False), str(path), ["w"])
    return path


def rewritten(src, dst, edit):
    """A copy of the archive with edit(members) applied: members by name, as bytes."""
    with zipfile.ZipFile(src) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    members = edit(members)
    with zipfile.ZipFile(dst, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return dst


def member(members, suffix):
    return next(name for name in members if name.endswith(suffix))


def program_edit(change):
    """An edit of models/model.json: change(program) alters the parsed program in place."""

    def edit(members):
        name = member(members, "models/model.json")
        program = json.loads(members[name])
        change(program)
        members[name] = json.dumps(program).encode()
        return members

    return edit


def graph(program):
    return program["graph_module"]["graph"]


def first_node(program):
    return graph(program)["nodes"][0]


def test_what_the_export_backend_writes_is_accepted(archive, tmp_path):
    program = check_archive(archive)
    assert "torch.ops.aten.linear.default" in {n["target"] for n in graph(program)["nodes"]}
    assert read_archive(archive, archive.read_bytes()) == ([([2, 4], "float32"), ([3, 4], "float32"), ([5, 4], "float32"), ([2], "int64")], ["w"])
    # Size expressions of sympy's integer vocabulary are data; they are accepted anywhere.
    expr = "Add(Mul(Integer(2), Symbol('s0', integer=True, positive=True)), Integer(-1))"
    ok = rewritten(archive, tmp_path / "expr.pt2", program_edit(lambda p: graph(p).setdefault("sym_int_values", {}).update(s0={"as_expr": {"expr_str": expr}})))
    check_archive(ok)


def _set(path_fn, key, value):
    return lambda p: path_fn(p).__setitem__(key, value)


CASES = {
    "an extra member": (
        lambda m: {**m, member(m, "models/model.json").replace("models/model.json", "data/constants/c0.pt"): b"x"},
        r"unexpected members \['data/constants/c0.pt'\]",
    ),
    "a missing member": (lambda m: {k: v for k, v in m.items() if not k.endswith("byteorder")}, r"unexpected members \['byteorder'\]"),
    "members in two folders": (lambda m: {**m, "other/archive_format": b"pt2"}, r"members in several folders \['other', 'program'\]"),
    "pickled sample inputs": (lambda m: {**m, member(m, "sample_inputs/model.pt"): b"\x80\x04K\x01."}, "it carries pickled sample inputs"),
    "weights": (
        lambda m: {**m, member(m, "model_weights_config.json"): json.dumps({"config": {"w": {"path_name": "w"}}}).encode()},
        r"data/weights/model_weights_config.json names pickled tensors",
    ),
    "constants": (
        lambda m: {**m, member(m, "model_constants_config.json"): json.dumps({"config": {"c": {"path_name": "c"}}}).encode()},
        r"data/constants/model_constants_config.json names pickled tensors",
    ),
    "no weights record": (lambda m: {k: v for k, v in m.items() if not k.endswith("aotc_weights.json")}, r"unexpected members \['extra/aotc_weights.json'\]"),
    "a weights record of another kind": (lambda m: {**m, member(m, "aotc_weights.json"): b'{"w": 1}'}, r"extra/aotc_weights.json is not a list of weight paths"),
    "not json": (lambda m: {**m, member(m, "models/model.json"): b"{"}, r"not an archive aotc wrote \(JSONDecodeError"),
    "guards code": (program_edit(_set(lambda p: p, "guards_code", ["import os"])), "it carries guards code"),
    "a python call": (program_edit(_set(first_node, "target", "builtins.eval")), r"calls 'builtins.eval', which is not an aten or prims op"),
    "an op of another namespace": (program_edit(_set(first_node, "target", "torch.ops.myns.run.default")), "which is not an aten or prims op"),
    "a graph argument": (program_edit(lambda p: first_node(p)["inputs"][0]["arg"].update(as_graph={})), r"takes an argument of kind 'as_graph'"),
    "a custom object output": (program_edit(lambda p: first_node(p)["outputs"].append({"as_custom_obj": {"name": "o"}})), r"returns a 'as_custom_obj'"),
    "custom objects": (program_edit(_set(graph, "custom_obj_values", {"o": {"name": "o"}})), "it carries custom_obj_values"),
    "a parameter input": (program_edit(lambda p: p["graph_module"]["signature"]["input_specs"].append({"parameter": {}})), r"an input of kind \['parameter'\]"),
    "a buffer mutation output": (
        program_edit(lambda p: p["graph_module"]["signature"]["output_specs"].append({"buffer_mutation": {}})),
        r"an output of kind \['buffer_mutation'\]",
    ),
    "a pytree spec type": (
        program_edit(lambda p: p["graph_module"].__setitem__("module_call_graph", [{"signature": {"in_spec": '[1, {"type": "os.system", "context": "null"}]'}}])),
        r'a pytree spec of type "os.system"',
    ),
    "a range constraint": (
        program_edit(_set(lambda p: p, "range_constraints", {"__import__('os')": {"min_val": 0, "max_val": 1}})),
        r"a range constraint on \"__import__\('os'\)\"",
    ),
    "an expression naming a function": (
        program_edit(_set(graph, "sym_int_values", {"s0": {"as_expr": {"expr_str": "Symbol('s0') + __import__('os').getpid()"}}})),
        r"a symbolic expression that names '__import__'",
    ),
    "an expression with an attribute": (
        program_edit(_set(graph, "sym_int_values", {"s0": {"as_expr": {"expr_str": "Integer(1).evalf"}}})),
        r"a symbolic expression 'Integer\(1\).evalf' that is not plain integer arithmetic",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_what_torch_would_unpickle_resolve_or_evaluate_is_refused(archive, tmp_path, case):
    edit, said = CASES[case]
    path = rewritten(archive, tmp_path / "program.pt2", edit)
    with pytest.raises(BundleError, match=said) as e:
        check_archive(path)
    assert str(e.value).startswith(f"{path}: refused, ") and "Rebuild the bundle (aotc build)" in str(e.value)


def test_a_file_that_is_not_a_zip_is_refused(tmp_path):
    path = tmp_path / "program.pt2"
    path.write_bytes(b"not a zip")
    with pytest.raises(BundleError, match=r"refused, not an archive aotc wrote \(BadZipFile"):
        check_archive(path)


def test_a_program_loads_the_same_through_aotcs_schema_decoder(archive, monkeypatch):
    """load_program decodes the archive's JSON with a decoder that resolves each schema type
    once (pytorch#196452): it rebuilds the objects torch's own decoder does, the program
    equals torch's own load node for node, and a second load looks up no type hints."""
    import typing

    from torch._export.serde import schema, serialize

    from aotc.backends import export

    data = archive.read_bytes()
    export.load_program(data)
    ours = serialize._dict_to_dataclass
    torchs = ours.__wrapped__
    assert torchs.__module__ == serialize.__name__ and ours is not torchs
    with zipfile.ZipFile(archive) as z:
        js = json.loads(z.read(next(n for n in z.namelist() if n.endswith("models/model.json"))))
    with monkeypatch.context() as m:
        m.setattr(serialize, "_dict_to_dataclass", torchs)  # torch as it ships, down to every nested value
        expected = torchs(schema.ExportedProgram, js)
        theirs = torch.export.load(archive)
    assert ours(schema.ExportedProgram, js) == expected
    loaded = export.load_program(data)
    assert loaded.graph_module.code == theirs.graph_module.code
    assert [(n.name, str(n.target), n.meta["val"].shape if "val" in n.meta and hasattr(n.meta["val"], "shape") else None) for n in loaded.graph.nodes] == [
        (n.name, str(n.target), n.meta["val"].shape if "val" in n.meta and hasattr(n.meta["val"], "shape") else None) for n in theirs.graph.nodes
    ]
    assert loaded.graph_signature == theirs.graph_signature
    looked_up = []
    real = typing.get_type_hints
    monkeypatch.setattr(typing, "get_type_hints", lambda *a, **k: looked_up.append(a[0]) or real(*a, **k))
    export.load_program(data)
    assert looked_up == []  # every type of this program was resolved by the first load


def test_a_program_saves_the_same_bytes_without_torchs_canonical_form_self_test(monkeypatch):
    """save_program skips the canonicalization torch.export.save runs only as a self-test
    (its result dropped): the archive is byte for byte torch's own, and torch's
    canonicalize is back in place afterwards."""
    import io

    from torch._export.serde import serialize

    args = (torch.randn(2, 4), torch.randn(3, 4), torch.zeros(5, 4), torch.tensor([0, 1]))
    program = torch.export.export(Step(), args, strict=False)
    own, ran = serialize.canonicalize, []
    monkeypatch.setattr(serialize, "canonicalize", lambda *a, **k: ran.append(1) or own(*a, **k))
    counted = serialize.canonicalize
    ours = io.BytesIO()
    save_program(program, ours, ["w"])
    assert ran == [] and serialize.canonicalize is counted
    program.example_inputs = None
    theirs = io.BytesIO()
    torch.export.save(program, theirs, extra_files={"aotc_weights.json": json.dumps(["w"])})
    assert ran == [1]  # torch's own save runs it
    assert ours.getvalue() == theirs.getvalue()
