"""kivi_ops.dispatch: the support matrix (docs/design.md's, rendered by dispatch.support_matrix), its errors, and the rule that only the
cache modules name cache buffers."""

import itertools
import pathlib
import re

import pytest
import torch

from kivi_ops import KIVICache, KIVIConfig, dispatch
from kivi_ops.dispatch import implementations
from kivi_ops.dispatch import Choice
from kivi_ops.kernels.decomposed.attend import attend_fused, attend_materialized
from kivi_ops.layout import LayerTensors

# ---------------------------------------------------------------- the support matrix

# docs/design.md's matrix, written out with its footnotes: (device, mode) -> (append, attend q_len == 1,
# attend q_len > 1), each (implementation, runs inside the kivi op).
OP, INLINE = True, False
REFERENCE_OP = (("reference", OP),) * 3
PORTABLE = (("decomposed", INLINE), ("decomposed_materialized", INLINE), ("decomposed_materialized", INLINE))
TRITON = (("triton", OP), ("triton_decode", OP), ("triton_split", OP))
MATRIX = {
    # q_len > 1 appends and cpu_kernels="reference": footnote 5 (expected_choice)
    ("cpu", "eager"): (("decomposed_cond", INLINE), ("decomposed_fused", INLINE), ("reference", OP)),
    ("cpu", "export"): REFERENCE_OP,
    ("cpu", "compile"): (("decomposed_cond", INLINE), ("decomposed_fused", INLINE), ("decomposed_materialized", INLINE)),
    ("cpu", "portable"): PORTABLE,
    ("cuda", "portable"): PORTABLE,
    ("cuda", "eager"): TRITON,
    ("cuda", "compile"): TRITON,
    ("cuda", "export"): TRITON,
    # "Other devices run the reference inside the op"; portable is the same on any device.
    ("mps", "eager"): REFERENCE_OP,
    ("mps", "compile"): REFERENCE_OP,
    ("mps", "export"): REFERENCE_OP,
    ("mps", "portable"): PORTABLE,
}
DEVICES = ("cpu", "cuda", "mps")

OPTIONS = ("pool", "nuq", "sparse", "pre_rope")


def expected_choice(op, device, mode, q_len, options, head_dim, cpu_kernels="compiled"):
    """The matrix cell, then its footnotes: (implementation, in_op, compiled)."""
    append, decode, longer = MATRIX[device, mode]
    impl, in_op = append if op == "append" else decode if q_len == 1 else longer
    if mode == "portable":
        return impl, in_op, False
    if (device, mode) == ("cpu", "eager") and (q_len > 1 or cpu_kernels == "reference"):  # footnote 5
        return "reference", OP, False
    compiled = (device, mode) == ("cpu", "eager")  # footnote 5
    kvquant = {"nuq", "sparse", "pre_rope"} & options
    if impl == "decomposed_fused" and kvquant:  # footnote 1
        impl = "decomposed_materialized"
    if impl == "triton_decode" and head_dim & (head_dim - 1):  # footnote 3
        impl = "triton_split"
    return impl, in_op, compiled


def layer_with(options, head_dim):
    """A LayerTensors with tiny tensors of the right rank (choose reads shapes and None-ness only)."""
    B, H, S, R, P, D = 1, 1, 8, 4, 2, head_dim
    t = LayerTensors(
        torch.zeros(B, H, S, D // 4, dtype=torch.uint8), torch.zeros(B, H, S // 4, D), torch.zeros(B, H, S // 4, D),
        torch.zeros(B, H, R, D), torch.zeros(B, H, S, D // 4, dtype=torch.uint8), torch.zeros(B, H, S, D // 4),
        torch.zeros(B, H, S, D // 4), torch.zeros(B, H, R, D), torch.zeros(B, dtype=torch.int64))
    if "pool" in options:
        t = t._replace(pool_k=torch.zeros(B, H, P, D), pool_v=torch.zeros(B, H, P, D),
                       pool_pos=torch.full((B, H, P), -1, dtype=torch.int64))
    if "nuq" in options:
        t = t._replace(k_levels=torch.zeros(4), v_levels=torch.zeros(4))
    if "sparse" in options:
        t = t._replace(k_sparse=torch.zeros(B, H, 2, D), k_sparse_idx=torch.zeros(B, H, 2, D, dtype=torch.int16),
                       v_sparse=torch.zeros(B, H, S, 1), v_sparse_idx=torch.zeros(B, H, S, 1, dtype=torch.int16))
    if "pre_rope" in options:
        t = t._replace(rope_inv_freq=torch.zeros(D // 2))
    return t


OPTION_SETS = [frozenset(c) for n in range(len(OPTIONS) + 1) for c in itertools.combinations(OPTIONS, n)]


def test_choose_follows_the_support_matrix():
    seen = set()
    walk = itertools.product(dispatch.OPS, DEVICES, dispatch.MODES, (1, 4), OPTION_SETS, (64, 48),
                             dispatch.CPU_KERNELS)
    for op, device, mode, q_len, options, head_dim, kernels in walk:
        got = dispatch.choose(op, device=device, mode=mode, q_len=q_len, layer=layer_with(options, head_dim),
                              cpu_kernels=kernels)
        want = expected_choice(op, device, mode, q_len, options, head_dim, kernels)
        where = (f"{op} on {device}, {mode}, q_len={q_len}, options={sorted(options)}, head_dim={head_dim}, "
                 f"cpu_kernels={kernels}")
        assert isinstance(got, Choice), where
        assert tuple(got[:3]) == want, where
        assert got.launch == (), where  # launch settings come only from the tuner (test_tuning.py)
        assert got.tune == (device == "cuda" and mode != "portable" and op == "attend" and q_len == 1), where
        seen.add(got.implementation)
    # the walk reaches every implementation but the opt-in CUDA C++ kernel (test_cuda_cpp_kernel.py)
    assert seen == set(implementations.IMPLEMENTATIONS) - {"cuda_cpp"}
    assert len(OPTION_SETS) == 16  # plain, each option alone, and every combination


# ---------------------------------------------------------------- decided once


def recording(ran, name, fn):
    def run(*args, **kwargs):
        ran.append(name)
        return fn(*args, **kwargs)
    return run


DESIGN = pathlib.Path(__file__).resolve().parent.parent / "docs" / "design.md"


def test_the_design_docs_matrix_is_the_rendering_of_choose():
    lines = DESIGN.read_text().splitlines()
    start = lines.index("| device | mode | append | attend, q_len = 1 | attend, q_len > 1 |")
    table = "\n".join(itertools.takewhile(lambda line: line.startswith("|"), lines[start:])) + "\n"
    without_footnotes = re.sub(r" \([¹²³⁴⁵⁶⁷⁸⁹ ]+\)", "", table)
    assert without_footnotes == dispatch.support_matrix()
    # and the rendering is choose's: the written-out matrix above agrees with it cell by cell
    for row in dispatch.support_matrix().splitlines()[2:]:
        device, modes, *cells = [cell.strip() for cell in row.strip("|").split("|")]
        for mode in modes.split(", "):
            for d in ("cpu", "cuda") if device == "any" else (device,):
                want = [f"{impl}{' (op)' if in_op else ''}" for impl, in_op in MATRIX[d, mode]]
                assert cells == want, (d, mode)


def test_the_layer_chooses_once_and_the_op_runs_its_choice(monkeypatch):
    """Each append and attention call asks choose once, in the layer; the op's kernel runs the
    implementation the layer passed it (its entry of the table) and does not ask again."""
    cache = KIVICache(KIVIConfig(2, 2, 8, 16), num_layers=1, batch_size=2, max_seq_len=64, num_kv_heads=2, head_dim=32)
    asked, ran, real_choose = [], [], dispatch.choose
    monkeypatch.setattr(dispatch, "choose", lambda op, **kw: asked.append(op) or real_choose(op, **kw))
    for op, name in (("append", "reference"), ("attend", "reference"), ("attend", "decomposed_materialized")):
        forms = implementations._TABLE[op][name]
        monkeypatch.setitem(implementations._TABLE[op], name, forms._replace(static=recording(ran, f"{op}:{name}",
                                                                                               forms.static)))
    with dispatch.cpu_kernels("reference"):  # eager CPU: both ops of a step inside the kivi op
        cache.layers[0].append(torch.randn(2, 2, 20, 32), torch.randn(2, 2, 20, 32))
        out = cache.layers[0].attend(torch.randn(2, 4, 1, 32))
    assert asked == ["append", "attend"] and ran == ["append:reference", "attend:reference"]
    # The op runs what it is given: here the materialized form, by hand, and its result.
    layer, params, query = cache.layers[0].tensors(), cache.layers[0].params, torch.randn(2, 4, 1, 32)
    got = torch.ops.kivi.cache_attend(query, *layer, None, *params, 0.25,
                                      implementation=implementations.index("decomposed_materialized"))
    assert ran[-1] == "attend:decomposed_materialized" and asked == ["append", "attend"]
    assert torch.equal(got, attend_materialized(query, layer, None, params, 0.25)) and out.shape == (2, 4, 1, 32)


def test_an_op_refuses_an_implementation_it_cannot_run():
    cache = KIVICache(KIVIConfig(2, 2, 8, 16), num_layers=1, batch_size=1, max_seq_len=32, num_kv_heads=1, head_dim=32)
    layer, params, query = cache.layers[0].tensors(), cache.layers[0].params, torch.randn(1, 1, 1, 32)
    with pytest.raises(ValueError, match=r"implementation must be one of the attend implementations, 0 \(reference\), "
                                         r".*; got 99"):
        torch.ops.kivi.cache_attend(query, *layer, None, *params, 0.25, implementation=99)
    with pytest.raises(ValueError, match=r"implementation must be one of the append implementations, .*; got "
                                         f"{implementations.index('triton_split')}"):
        torch.ops.kivi.cache_append(*layer, query, query, None, *params,
                                    implementation=implementations.index("triton_split"))
    with pytest.raises(ValueError, match=r"tune=True is for CUDA decode calls .* got a cpu query with q_len 1"):
        torch.ops.kivi.cache_attend(query, *layer, None, *params, 0.25, tune=True)


def test_decode_kernel_is_left_out_where_triton_cannot_compile_it(monkeypatch):
    # Triton < 3.8 fails to compile triton_decode with pre-RoPE keys and a pool in fp16/bf16
    # (H200, Triton 3.6): those decode steps take triton_split. Nothing else changes.
    def half(options):
        t = layer_with(options, 64)
        return t._replace(k_res=t.k_res.half())

    def decode_choice(layer):
        return dispatch.choose("attend", device="cuda", mode="compile", q_len=1, layer=layer).implementation

    both = frozenset({"pool", "pre_rope"})
    assert decode_choice(half(both)) == "triton_decode"  # the Triton this project pins (3.8)
    monkeypatch.setattr(dispatch, "_triton_older_than", lambda major, minor: (major, minor) == (3, 8))
    assert decode_choice(half(both)) == "triton_split"
    assert decode_choice(layer_with(both, 64)) == "triton_decode"  # fp32 compiles
    assert decode_choice(half(frozenset({"pool"}))) == "triton_decode"
    assert decode_choice(half(frozenset({"pre_rope"}))) == "triton_decode"


def test_compiled_decode_report():
    assert dispatch.compiled_decode("cpu") == {"append": "decomposed_cond", "attend": "decomposed_fused"}
    assert dispatch.compiled_decode("cuda") == {"append": "triton", "attend": "triton_decode"}
    assert dispatch.compiled_decode("cuda", head_dim=48) == {"append": "triton", "attend": "triton_split"}


def test_choose_and_run_reject_unknown_names():
    layer = layer_with(frozenset(), 64)
    with pytest.raises(ValueError, match=r"op must be one of \('append', 'attend'\), got 'nope'"):
        dispatch.choose("nope", device="cpu", mode="eager", q_len=1, layer=layer)
    with pytest.raises(ValueError, match=r"mode must be one of \('eager', 'compile', 'export', 'portable'\), "
                                         r"got 'jit'"):
        dispatch.choose("attend", device="cpu", mode="jit", q_len=1, layer=layer)
    with pytest.raises(ValueError, match=r"cpu_kernels must be one of \('compiled', 'reference'\), got 'fast'"):
        dispatch.choose("attend", device="cpu", mode="eager", q_len=1, layer=layer, cpu_kernels="fast")
    with pytest.raises(ValueError, match=r"cpu kernels must be one of \('compiled', 'reference'\), got 'fast'"):
        dispatch.set_cpu_kernels("fast")
    with pytest.raises(ValueError, match="no append implementation 'nope'"):
        implementations.run_append("nope", layer, None, None, None, None)
    with pytest.raises(ValueError, match="no attend implementation 'nope'"):
        implementations.run_attend("nope", None, layer, None, None, 1.0)


def test_attend_form_follows_q_len_and_portable():
    # (was test_decomposed.py's form="auto" test) Compiled on CPU, decode (q_len == 1) runs the
    # fused form and longer queries the materialized one; a portable cache runs the materialized
    # form in eager mode too.
    cfg = KIVIConfig(2, 2, 8, 16)
    cache, portable = (KIVICache(cfg, num_layers=1, batch_size=2, max_seq_len=64, num_kv_heads=2, head_dim=32,
                                 portable=p) for p in (False, True))
    kv = torch.randn(2, 2, 40, 32), torch.randn(2, 2, 40, 32)
    cache.layers[0].append(*kv)
    portable.layers[0].append(*kv)
    layer, params = cache.layers[0].tensors(), cache.layers[0].params
    assert dispatch.current_mode(False) == "eager" and dispatch.current_mode(True) == "portable"
    for q in (1, 4):
        query = torch.randn(2, 4, q, 32)
        choice = dispatch.choose("attend", device="cpu", mode="compile", q_len=q, layer=layer)
        name, form = ("decomposed_fused", attend_fused) if q == 1 else ("decomposed_materialized", attend_materialized)
        assert choice == Choice(name, in_op=False)
        got = implementations.run_attend(choice.implementation, query, layer, None, params, 0.2)
        assert torch.equal(got, form(query, layer, None, params, 0.2))
        assert torch.equal(portable.layers[0].attend(query, scale=0.2),
                           attend_materialized(query, layer, None, params, 0.2))


# ---------------------------------------------------------------- buffer names

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCANNED = ("kivi_ops", "models", "export", "benchmarks", "tests")
# The modules that own cache buffers and may name them.
# (row_view.py builds a cache's first-rows view out of its modules' own buffers.)
OWNERS = {ROOT / "kivi_ops" / "cache" / name for name in ("static.py", "layer.py", "fp_layer.py", "row_view.py")}
# getattr/setattr/... with an f-string name glued to a placeholder by "_": getattr(cache, f"k_{i}"),
# getattr(a, f"{name}_0").
ATTR_BY_FSTRING = re.compile(
    r"""\b(?:getattr|setattr|hasattr|delattr|register_buffer)\(\s*(?:[^,()]|\([^()]*\))*,\s*"""
    r"""f["'][^"'\n]*(?:_\{|\}_)""")
# Module._buffers, the dict behind named buffers.
BUFFER_DICT = re.compile(r"\._buffers\b")
# Old-style per-layer buffer names built from strings (f"{n}_{i}", f"cache.{name}_0") on a line
# about cache buffers.
NAME_BY_FSTRING = re.compile(r"""\bf["'][^"'\n]*\}_(?:\d+|\{[^}]*\})["']""")
CACHE_LINE = re.compile(r"buffers\(|\bcache|\bstate\b|layer_")


def name_building(line: str) -> bool:
    return bool(ATTR_BY_FSTRING.search(line) or BUFFER_DICT.search(line)
                or (NAME_BY_FSTRING.search(line) and CACHE_LINE.search(line)))


def test_scan_patterns_catch_buffer_names_built_from_strings():
    for line in ('x = getattr(cache, f"k_codes_{layer}")', 'getattr(self.cache, f"k_{i}")',
                 'assert torch.equal(getattr(a, f"{name}_0"), getattr(b, f"{name}_0")), name',
                 'setattr(module, f"v_res_{i}", t)', 'bufs = cache._buffers["k_0"]',
                 'assert [n for n, _ in cache.named_buffers()] == [f"{n}_{i}" for i in range(2) for n in NAMES]',
                 'assert torch.equal(state[f"cache.{name}_0"], buf), name'):
        assert name_building(line), line
    for line in ('method = getattr(args, "method", "kivi")', 'getattr(t, "shape", t)',
                 'row.update({f"{method}_{k}": v for k, v in m.items()})',
                 'for name, buf in cache.named_buffers():', 'bufs = cache.layers[0].tensors().kivi',
                 'raise ValueError(f"{name} must be >= 0, got {v}")'):
        assert not name_building(line), line


def test_only_the_cache_modules_build_buffer_names():
    here = pathlib.Path(__file__).resolve()  # this file spells the patterns out
    found = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path in OWNERS or path == here:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if name_building(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "cache buffer names built from strings (use the layer modules):\n" + "\n".join(found)
