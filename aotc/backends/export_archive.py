"""What an export artifact may hold before torch loads it.

torch.export.load unpickles the archive's weights, constants and sample
inputs, resolves every node target by name (`torch.os.system` resolves), and
parses symbolic expressions with sympy, which evaluates them. So before an
export bundle's `program.pt2` reaches torch, this module reads it as data and
refuses anything aotc's export backend does not write:

1. exactly the archive members torch writes for a program with no weights,
   no constants and no sample inputs (nothing that would be unpickled), and
   aotc's record of which tensor each weight input is (a JSON list);
2. every call target an aten or prims overload, a functional collective
   (all_reduce, all_gather_into_tensor, reduce_scatter_tensor, wait_tensor), `operator.getitem`, or one of
   the integer comparisons and arithmetic that unbacked sizes use;
3. every argument of a plain kind (tensors, numbers, dtypes, devices...):
   no graphs, operators or custom objects;
4. every symbolic expression made of sympy's integer vocabulary and symbol
   names (`u0`, `s1`), nothing that sympify could run;
5. only user inputs and outputs (input mutations included), no guards code.
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from pathlib import Path

from ..errors import BundleError

WEIGHTS_MEMBER = "aotc_weights.json"  # torch.export.save's extra file: which tensor each weight input is
MEMBERS = {
    "models/model.json", "data/weights/model_weights_config.json", "data/constants/model_constants_config.json",
    "data/sample_inputs/model.pt", "archive_format", "archive_version", ".data/version", "byteorder", ".data/serialization_id",
    f"extra/{WEIGHTS_MEMBER}",
}  # fmt: skip
EMPTY_CONFIG = {"config": {}}
TARGET = re.compile(
    r"torch\.ops\.(aten|prims)\.\w+\.\w+|torch\.ops\._c10d_functional\.(all_reduce|all_gather_into_tensor|reduce_scatter_tensor|wait_tensor)\.default|_operator\.(getitem|ge|gt|le|lt|eq|ne|add|sub|mul|floordiv|mod|neg|truediv)"
)
ARG_KINDS = {
    "as_none", "as_tensor", "as_tensors", "as_int", "as_ints", "as_float", "as_floats", "as_string", "as_strings",
    "as_bool", "as_bools", "as_sym_int", "as_sym_ints", "as_sym_bool", "as_sym_bools", "as_sym_float", "as_sym_floats",
    "as_scalar_type", "as_memory_format", "as_layout", "as_device", "as_optional_tensors", "as_optional_tensor",
}  # fmt: skip
# sympy's srepr of integer size expressions: class names, symbol names and integers only.
EXPR_WORDS = {
    "Symbol", "Integer", "Add", "Mul", "Pow", "Max", "Min", "Mod", "FloorDiv", "CleanDiv", "CeilToInt", "FloorToInt",
    "Equality", "Unequality", "GreaterThan", "LessThan", "StrictGreaterThan", "StrictLessThan", "And", "Or", "Not",
    "integer", "positive", "nonnegative", "True", "False", "true", "false", "oo", "Infinity", "NegativeInfinity",
}  # fmt: skip
EXPR_TOKEN = re.compile(r"\s*(?:(?P<word>[A-Za-z_]\w*)|(?P<name>'[us]\d+')|-?\d+|[(),=*+\-])")
SPEC_TYPES = {"builtins.tuple", "builtins.list", "builtins.dict", None}


def read_archive(path: Path, data: bytes) -> tuple[list[tuple[list[int], str]], list[str]]:
    """check_archive of the archive's bytes, and what a loader needs of its JSON: the
    program's inputs (shape, dtype name) and which tensor each weight input is
    (Specs.weight_paths)."""
    program, weights = _checked(path, data)
    return _inputs(program), weights


def _inputs(program: dict) -> list[tuple[list[int], str]]:
    # torch's own table from the archive's dtype numbers (read only, no public equivalent)
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

    graph = program["graph_module"]["graph"]
    out = []
    for spec in graph["inputs"]:
        value = graph["tensor_values"][spec["as_tensor"]["name"]]
        sizes = [s.get("as_int") for s in value["sizes"]]  # inputs are static: no as_expr
        dtype = _SERIALIZE_TO_TORCH_DTYPE.get(value["dtype"])
        out.append((sizes, str(dtype).removeprefix("torch.")))
    return out


def check_archive(path: Path, data: bytes | None = None) -> dict:
    """Refuse an export archive that holds anything aotc's export backend does not write;
    returns the program's JSON. `data`: the archive's bytes, read once by a caller that
    hands the same bytes to torch next (else the file at `path` is read)."""
    return _checked(path, data)[0]


def _checked(path: Path, data: bytes | None = None) -> tuple[dict, list[str]]:
    try:
        with zipfile.ZipFile(path if data is None else io.BytesIO(data)) as z:
            infos = {i.filename: i for i in z.infolist()}
            prefixes = {name.split("/", 1)[0] for name in infos}
            if len(prefixes) != 1:
                _refuse(path, f"members in several folders {sorted(prefixes)}")
            prefix = prefixes.pop()
            members = {name.split("/", 1)[1] for name in infos if "/" in name and not name.endswith("/")}
            if members != MEMBERS:
                _refuse(path, f"unexpected members {sorted(members ^ MEMBERS)}")
            if infos[f"{prefix}/data/sample_inputs/model.pt"].file_size:
                _refuse(path, "it carries pickled sample inputs")
            for config in ("data/weights/model_weights_config.json", "data/constants/model_constants_config.json"):
                if json.loads(z.read(f"{prefix}/{config}")) != EMPTY_CONFIG:
                    _refuse(path, f"{config} names pickled tensors; aotc's programs take every weight as an input")
            weights = json.loads(z.read(f"{prefix}/extra/{WEIGHTS_MEMBER}"))
            if not isinstance(weights, list) or not all(isinstance(w, str) for w in weights):
                _refuse(path, f"extra/{WEIGHTS_MEMBER} is not a list of weight paths")
            program = json.loads(z.read(f"{prefix}/models/model.json"))
    except (zipfile.BadZipFile, json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
        _refuse(path, f"not an archive aotc wrote ({type(e).__name__}: {e})")
    _check_program(path, program)
    return program, weights


def _check_program(path: Path, program: dict) -> None:
    if program.get("guards_code"):
        _refuse(path, "it carries guards code")
    gm = program["graph_module"]
    graph = gm["graph"]
    for node in graph["nodes"]:
        name = ",".join(str(o) for o in node.get("outputs", []))[:80]
        if not TARGET.fullmatch(str(node.get("target"))):
            _refuse(path, f"node {name} calls {node.get('target')!r}, which is not an aten or prims op")
        for arg in node["inputs"]:
            for kind in arg["arg"]:
                if kind not in ARG_KINDS:
                    _refuse(path, f"node {name} ({node['target']}) takes an argument of kind {kind!r}")
        for out in node["outputs"]:
            for kind in out:
                if kind not in ARG_KINDS:
                    _refuse(path, f"node {name} ({node['target']}) returns a {kind!r}")
    for kind in ("custom_obj_values",):
        if graph.get(kind):
            _refuse(path, f"it carries {kind}")
    for spec in gm["signature"]["input_specs"]:
        if set(spec) != {"user_input"}:
            _refuse(path, f"an input of kind {sorted(spec)} (aotc's programs take user inputs only)")
    for spec in gm["signature"]["output_specs"]:
        if not set(spec) <= {"user_output", "user_input_mutation"}:
            _refuse(path, f"an output of kind {sorted(spec)}")
    for call in gm.get("module_call_graph", []):
        for key in ("in_spec", "out_spec"):
            text = (call.get("signature") or {}).get(key) or "[]"
            for t in re.findall(r'"type":\s*("(?:[^"\\]|\\.)*"|null)', text.replace('\\"', '"')):
                if json.loads(t) not in SPEC_TYPES:
                    _refuse(path, f"a pytree spec of type {t}")
    for symbol in program.get("range_constraints", {}):
        if not re.fullmatch(r"[us]\d+", symbol):
            _refuse(path, f"a range constraint on {symbol[:40]!r}")
    _check_exprs(path, program)


def _check_exprs(path: Path, node) -> None:
    """Every `expr_str` anywhere in the program: sympy integer vocabulary only."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr_str":
                _check_expr(path, str(value))
            else:
                _check_exprs(path, value)
    elif isinstance(node, list):
        for value in node:
            _check_exprs(path, value)


def _check_expr(path: Path, text: str) -> None:
    pos = 0
    while pos < len(text):
        m = EXPR_TOKEN.match(text, pos)
        if not m or m.end() == pos:
            _refuse(path, f"a symbolic expression {text[:80]!r} that is not plain integer arithmetic")
        if m.group("word") and m.group("word") not in EXPR_WORDS:
            _refuse(path, f"a symbolic expression that names {m.group('word')!r}")
        pos = m.end()


def _refuse(path: Path, why: str):
    raise BundleError(f"{path}: refused, {why}; aotc loads only programs it wrote. Rebuild the bundle (aotc build)")
