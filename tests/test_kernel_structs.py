"""The ctypes mirrors of the kernels' argument structs (``hoccl.backends._cuda_structs``)
match the one definition, the C structs in the kernel source (``_kernels``): the same
fields in the same order, of matching types, at the same offsets, in structs of the same
size.  A struct passed by value with a field out of place would feed a kernel garbage.
No GPU, no driver: the offsets of the C side are computed from the text with the C ABI's
rules for these types (natural alignment, x86-64 and aarch64 alike)."""

import ctypes
import re

import pytest

from hoccl.backends import _cuda_structs as structs
from hoccl.backends import _kernels

MIRRORS = {"ReduceArgs": structs._ReduceArgs, "ChunkArgs": structs._ChunkArgs,
           "CopyArgs": structs._CopyArgs, "DirectOp": structs._DirectOp,
           "DirectInput": structs._DirectInput, "DirectArgs": structs._DirectArgs}
#: the C scalar types of the structs: (size, alignment, the ctypes types that mirror them)
SCALARS = {"unsigned long long": (8, 8, (ctypes.c_uint64,)),
           "unsigned int": (4, 4, (ctypes.c_uint32,)),
           "double": (8, 8, (ctypes.c_double,))}
POINTER = (8, 8, (ctypes.c_void_p, ctypes.c_uint64))  # an address in a 64-bit word
#: the array bounds of the source, as ``compile_options`` and ``direct_compile_options`` set
BOUNDS = {"HOCCL_MAX_INPUTS": _kernels.MAX_INPUTS, "HOCCL_CHUNK_FLAGS": _kernels.CHUNK_FLAGS,
          "HOCCL_DIRECT_OPS": _kernels.DIRECT_OPS, "HOCCL_DIRECT_INPUTS": _kernels.DIRECT_INPUTS}
FIELD = re.compile(r"^(?P<type>[A-Za-z_][\w ]*?)\s*(?P<pointer>\*?)\s*(?P<name>\w+)"
                   r"(?:\[(?P<bound>\w+)\])?$")


def c_structs(source, names):
    """{name: [(field, type, is_pointer, bound or None)]} of the structs ``names`` in
    ``source`` (the others, the element types' traits, are not arguments)."""
    found = {}
    for name, body in re.findall(r"struct (\w+) \{(.*?)\n\};", source, re.S):
        if name not in names:
            continue
        fields = []
        for declaration in re.sub(r"//[^\n]*", "", body).split(";"):
            declaration = " ".join(declaration.split())
            if not declaration:
                continue
            match = FIELD.match(declaration)
            assert match, f"struct {name}: cannot read {declaration!r}"
            kind = match["type"].removeprefix("const ").strip()
            fields.append((match["name"], kind, bool(match["pointer"]), match["bound"]))
        found[name] = fields
    return found


def layout(fields, known):
    """(offsets, size, alignment) of a C struct whose fields are ``fields``."""
    offset, alignment, offsets = 0, 1, []
    for _, kind, pointer, bound in fields:
        size, align = (POINTER if pointer else SCALARS[kind] if kind in SCALARS
                       else known[kind])[:2]
        count = BOUNDS[bound] if bound else 1
        offset = -(-offset // align) * align
        offsets.append(offset)
        offset += size * count
        alignment = max(alignment, align)
    return offsets, -(-offset // alignment) * alignment, alignment


def mismatches(source, mirrors):
    """What differs between the structs of ``source`` and their ctypes ``mirrors``."""
    found, known, wrong = c_structs(source, mirrors), {}, []
    for name, fields in found.items():
        mirror = mirrors[name]
        offsets, size, alignment = layout(fields, known)
        known[name] = (size, alignment, (mirror,))
        theirs = [field[0] for field in mirror._fields_]
        if theirs != [field[0] for field in fields]:
            wrong.append(f"{name}: fields {[field[0] for field in fields]} in C, {theirs} "
                         f"in ctypes")
            continue
        for (field, kind, pointer, bound), offset, (_, mirrored) in zip(fields, offsets,
                                                                       mirror._fields_):
            element = mirrored._type_ if bound else mirrored
            accepted = (POINTER if pointer else SCALARS[kind] if kind in SCALARS
                        else known[kind])[2]
            if element not in accepted or (bound and mirrored._length_ != BOUNDS[bound]):
                wrong.append(f"{name}.{field}: {kind}{'*' if pointer else ''}"
                             f"{f'[{bound}]' if bound else ''} in C, {mirrored.__name__} in "
                             f"ctypes")
            if getattr(mirror, field).offset != offset:
                wrong.append(f"{name}.{field}: offset {offset} in C, "
                             f"{getattr(mirror, field).offset} in ctypes")
        if ctypes.sizeof(mirror) != size:
            wrong.append(f"{name}: {size} bytes in C, {ctypes.sizeof(mirror)} in ctypes")
    missing = sorted(set(mirrors) - set(found))
    return wrong + [f"{name}: no such struct in the source" for name in missing]


def kernel_source():
    """The direct kernel's source: it holds every struct (the reductions' too)."""
    return _kernels.direct_source("float32", "sum")


def test_every_mirror_matches_its_struct_in_the_kernel_source():
    assert set(c_structs(kernel_source(), MIRRORS)) == set(MIRRORS)
    assert mismatches(kernel_source(), MIRRORS) == []


def test_the_reduction_kernels_source_has_the_same_structs():
    shared = {name: MIRRORS[name] for name in ("ReduceArgs", "ChunkArgs", "CopyArgs")}
    assert set(c_structs(_kernels.source(), MIRRORS)) == set(shared)
    assert mismatches(_kernels.source(), shared) == []


@pytest.mark.parametrize("fault,expected", [
    (("    unsigned long long count;    // elements\n    unsigned long long head;",
      "    unsigned long long head;\n    unsigned long long count;    // elements"),
     "ReduceArgs: fields"),
    (("    unsigned int num_ops;", "    unsigned long long num_ops;"), "DirectArgs.num_ops"),
    (("    const unsigned long long* flags[HOCCL_CHUNK_FLAGS];",
      "    const unsigned long long* flags[HOCCL_MAX_INPUTS];"), "ChunkArgs.flags"),
    (("    unsigned int unused;\n", ""), "DirectArgs: fields"),
])
def test_the_check_finds_a_planted_difference(fault, expected):
    before, after = fault
    source = kernel_source()
    assert before in source
    found = mismatches(source.replace(before, after, 1), MIRRORS)
    assert found and any(line.startswith(expected) for line in found), found


def test_the_check_finds_a_mirror_whose_field_moved():
    class Moved(ctypes.Structure):
        _fields_ = [("dst", ctypes.c_void_p), ("src", ctypes.c_void_p),
                    ("head", ctypes.c_uint64), ("nbytes", ctypes.c_uint64)]
    found = mismatches(kernel_source(), {**MIRRORS, "CopyArgs": Moved})
    assert found == ["CopyArgs: fields ['dst', 'src', 'nbytes', 'head'] in C, "
                     "['dst', 'src', 'head', 'nbytes'] in ctypes"]
