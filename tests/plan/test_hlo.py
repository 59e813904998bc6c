"""The compiled-HLO reader (k3jax/plan/hlo.py): loop bodies counted by their trip counts, collectives found and
sized, FLOPs against hand counts and against XLA's own cost analysis of the unrolled program."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax.plan.hlo import arrays, parse, shape_bytes, trip_count, tuple_elements
from k3jax.plan.hlo_bytes import instr_io
from k3jax.plan.hlo_cost import program_stats

L, M, D = 5, 16, 64


def _stack(unroll: bool):
    def f(w, x):
        def body(c, wi):
            return jnp.tanh(c @ wi), None

        if unroll:
            for i in range(L):
                x, _ = body(x, w[i])
            return x.sum()
        return jax.lax.scan(body, x, w)[0].sum()

    return f


def _compile(fn, *args):
    return jax.jit(fn).lower(*args).compile()


ARGS = (jax.ShapeDtypeStruct((L, D, D), jnp.float32), jax.ShapeDtypeStruct((M, D), jnp.float32))


@pytest.mark.parametrize("grad", [False, True])
def test_scan_flops_are_the_unrolled_flops(grad):
    """A scan's body counts L times: the scanned and the unrolled program's dot FLOPs equal the hand count (forward
    L matmuls of 2·M·D·D; with the gradient w.r.t. the weights two more per layer, less the input gradient of
    layer 0, which only the unrolled program can drop), and XLA's cost analysis of the unrolled program (which
    has no loop to undercount) agrees within its elementwise extra."""
    f = jax.grad(_stack(False)) if grad else _stack(False)
    g = jax.grad(_stack(True)) if grad else _stack(True)
    want = (3 if grad else 1) * L * 2 * M * D * D
    scanned, unrolled = _compile(f, *ARGS), _compile(g, *ARGS)
    s, u = program_stats(scanned.as_text()), program_stats(unrolled.as_text())
    unrolled_want = want - (2 * M * D * D if grad else 0)
    assert s.flops == want and u.flops == unrolled_want
    assert L in s.trip_counts and s.unknown_trip_counts == 0
    assert s.flops_once < want  # a loop body counted once, as cost_analysis counts it
    xla = unrolled.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    assert unrolled_want <= xla["flops"] <= 1.2 * unrolled_want
    # HBM traffic: the unrolled program's estimate against XLA's own (no loop there to undercount)
    assert 0.67 < u.bytes_accessed / xla["bytes accessed"] < 1.5
    assert s.bytes_accessed > s.bytes_accessed_once


def test_collectives_in_a_loop_are_counted_per_iteration():
    """Weights sharded over 4 devices: the scanned forward all-gathers one layer per iteration — L gathers of a
    [D, D] f32 result per step, found inside the while body."""
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    w = jax.ShapeDtypeStruct((L, D, D), jnp.float32, sharding=NamedSharding(mesh, P(None, None, "x")))
    x = jax.ShapeDtypeStruct((M, D), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    s = program_stats(_compile(_stack(False), w, x).as_text())
    gathers = s.collectives["all-gather"]
    assert gathers["count"] == L * s.collectives_once["all-gather"]["count"]
    assert gathers["bytes"] == L * D * D * 4
    assert s.flops == L * 2 * (M // 4) * D * D  # per device: a quarter of the rows


def test_nested_loops_multiply():
    def f(x):
        def outer(c, _):
            def inner(d, _):
                return jnp.sin(d @ d), None
            return jax.lax.scan(inner, c, None, length=3)[0], None
        return jax.lax.scan(outer, x, None, length=4)[0]

    s = program_stats(_compile(f, jax.ShapeDtypeStruct((D, D), jnp.float32)).as_text())
    assert s.flops == 12 * 2 * D**3
    assert sorted(set(s.trip_counts)) == [3, 4]


def test_shapes_and_trip_counts_from_text():
    assert arrays("(s32[], f32[16,256]{1,0}, /*index=5*/bf16[2,3]{1,0:T(8,128)(2,1)})") == [
        ("s32", ()), ("f32", (16, 256)), ("bf16", (2, 3))]
    assert shape_bytes("(f32[4], u8[10], f4e2m1fn[8])") == 16 + 10 + 4
    assert shape_bytes("(f32[4], f32[100])", largest=True) == 400
    text = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  ROOT %t = (s32[], f32[8]) tuple(%p)
}

%cond (p.1: (s32[], f32[8])) -> pred[] {
  %p.1 = (s32[], f32[8]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: (s32[], f32[8])) -> (s32[], f32[8]) {
  %a = (s32[], f32[8]) parameter(0)
  ROOT %w = (s32[], f32[8]) while(%a), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
}
"""
    comps, entry = parse(text)
    assert entry == "main" and set(comps) == {"body", "cond", "main"}
    assert trip_count(comps["main"].instrs[-1]) == 7
    assert program_stats(text).trip_counts == [7]
    with pytest.raises(ValueError, match="ENTRY"):
        parse("HloModule m\n")


TPU_STYLE = """HloModule m

%body (p: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %p = (s32[]{:T(128)}, f32[8,8]{1,0:T(8,128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %x = f32[8,8]{1,0:T(8,128)} get-tuple-element(%p), index=1
  %one = s32[]{:T(128)} constant(1)
  %j = s32[]{:T(128)} add(%i, %one)
  %y = f32[8,8]{1,0:T(8,128)} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[]{:T(128)}, f32[8,8]{1,0:T(8,128)}) tuple(%j, %y)
}

%cmp (a: s32[], b: s32[]) -> pred[] {
  %a = s32[]{:T(128)} parameter(0)
  %b = s32[]{:T(128)} parameter(1)
  ROOT %lt = pred[]{:T(512)} compare(%a, %b), direction=LT
}

%cond (q: (s32[], f32[8,8])) -> pred[] {
  %bound = s32[]{:T(128)} constant(9)
  %q = (s32[]{:T(128)}, f32[8,8]{1,0:T(8,128)}) parameter(0)
  %k = s32[]{:T(128)} get-tuple-element(%q), index=0
  ROOT %f = pred[]{:T(512)} fusion(%k, %bound), kind=kLoop, calls=%cmp
}

ENTRY %main (x0: f32[8,8]) -> (s32[], f32[8,8]) {
  %x0 = f32[8,8]{1,0:T(8,128)} parameter(0)
  %start = s32[]{:T(128)} constant(2)
  %init = (s32[]{:T(128)}, f32[8,8]{1,0:T(8,128)}) tuple(%start, %x0)
  ROOT %w = (s32[]{:T(128)}, f32[8,8]{1,0:T(8,128)}) while(%init), condition=%cond, body=%body
}
"""


def test_trip_count_read_from_the_loop_when_the_backend_prints_none():
    """XLA:TPU prints no known_trip_count: the count is read from the condition (induction < 9, here through a
    fused compare) and the induction variable's constant start (2): 7 iterations of one 8x8 matmul. A bound that
    is not a constant leaves the loop unknown (counted once)."""
    s = program_stats(TPU_STYLE)
    assert s.trip_counts == [7] and s.unknown_trip_counts == 0
    assert s.flops == 7 * 2 * 8**3 and s.flops_once == 2 * 8**3
    dynamic = TPU_STYLE.replace("%start = s32[]{:T(128)} constant(2)", "%start = s32[]{:T(128)} parameter(1)")
    s = program_stats(dynamic)
    assert s.trip_counts == [] and s.unknown_trip_counts == 1 and s.flops == 2 * 8**3


@pytest.mark.parametrize("padding, taps", [("VALID", 6 * 3), ("SAME", 8 * 3 - 2),
                                           ([(7, 7)], 8 * 3)])  # wide padding: every input read by all 3 taps
def test_convolution_flops_count_real_taps_not_padding(padding, taps):
    """A 1-D convolution over 8 positions with a 3-tap kernel: FLOPs = 2 · batch · out features · (output, tap)
    pairs that read a real input · in features; taps landing in padding are not counted (XLA:TPU writes some
    matmuls as a convolution whose window is mostly padding)."""
    b, i, o = 2, 4, 5
    x = jax.ShapeDtypeStruct((b, i, 8), jnp.float32)
    w = jax.ShapeDtypeStruct((o, i, 3), jnp.float32)
    f = lambda x, w: jax.lax.conv_general_dilated(x, w, (1,), padding)  # noqa: E731
    s = program_stats(_compile(f, x, w).as_text())
    assert s.flops == 2 * b * o * taps * i


_KERNEL_LOOP = """HloModule m

%body (p: (s32[], f32[8,128])) -> (s32[], f32[8,128]) {
  %p = (s32[], f32[8,128]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,128] get-tuple-element(%p), index=1
  %kern.7 = f32[8,128] custom-call(%x), custom_call_target="tpu_custom_call", backend_config={CONFIG}
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,128]) tuple(%n, %kern.7)
}

%cond (q: (s32[], f32[8,128])) -> pred[] {
  %q = (s32[], f32[8,128]) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %lim = s32[] constant(5)
  ROOT %lt = pred[] compare(%j, %lim), direction=LT
}

ENTRY %main (a: f32[8,128]) -> f32[8,128] {
  %a = f32[8,128] parameter(0)
  %b = f32[8,128] add(%a, %a)
  %c = f32[8,128] multiply(%b, %b)
  %cs = (f32[8,128]{1,0:S(1)}, f32[8,128], u32[]) copy-start(%c)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,128]) tuple(%zero, %c)
  %w = (s32[], f32[8,128]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8,128] get-tuple-element(%w), index=1
}
""".replace("{CONFIG}", '{"custom_call_config":{"body":"AA","cost_estimate":{"flops":"1000","transcendentals":"0",'
            '"bytes_accessed":"64","remote_bytes_transferred":"0"}}}')


def test_custom_calls_are_charged_their_cost_estimate_per_iteration():
    """A kernel inside a 5-trip loop: its declared FLOPs and bytes count 5 times (custom_calls, kernels, the
    ``kernels`` share of HBM); reads of the argument are weights, the rest activations; a copy into VMEM (S(1))
    writes no HBM byte."""
    s = program_stats(_KERNEL_LOOP)
    A = 8 * 128 * 4
    assert s.custom_calls == {"tpu_custom_call": 5}
    assert s.kernels == {"kern": {"count": 5, "flops": 5000.0, "bytes": 320.0, "estimated": True}}
    assert s.flops == 5000.0
    # add: reads a twice (weights), writes b; multiply: reads b twice, writes c; copy-start (a prefetch: its
    # destination, element 0, is in VMEM) reads c and writes no HBM byte; the loop counter's add: two s32 reads and a
    # write per trip
    want = {"weights": 2 * A, "activations": A + 3 * A + A + 5 * 12, "kernels": 320.0, "collectives": 0.0}
    assert s.hbm_split == want
    assert s.bytes_accessed == sum(s.hbm_split.values())


def test_copy_start_writes_its_destination():
    """XLA's ``copy-start`` is shaped (destination, source, context) and its ``copy-done`` returns element 0: memory
    space assignment's prefetch (destination in VMEM) reads HBM and writes none, its eviction (source in VMEM) reads
    none and writes HBM — unlike the collectives' ``*-start``, whose result is element 1."""
    text = """HloModule m

ENTRY %main (a: f32[8,128]) -> f32[8,128] {
  %a = f32[8,128] parameter(0)
  %b = f32[8,128] add(%a, %a)
  %pf = (f32[8,128]{1,0:S(1)}, f32[8,128], u32[]) copy-start(%b)
  %pd = f32[8,128]{1,0:S(1)} copy-done(%pf)
  %ev = (f32[8,128], f32[8,128]{1,0:S(1)}, u32[]) copy-start(%pd)
  ROOT %ed = f32[8,128] copy-done(%ev)
}
"""
    comps, entry = parse(text)
    c = comps[entry]
    by = {i.name: i for i in c.instrs}
    A = 8 * 128 * 4
    assert instr_io(by["pf"], c, comps) == (0.0, [("b", A)])
    assert instr_io(by["ev"], c, comps) == (A, [("pd", 0.0)])


def test_tuple_elements_and_on_chip_arrays():
    shape = "((bf16[16,14]{1,0:T(8,128)(2,1)}, s32[32]{0}), bf16[32,14]{1,0}, u32[]{:S(8)})"
    assert tuple_elements(shape) == ["(bf16[16,14]{1,0:T(8,128)(2,1)}, s32[32]{0})", "bf16[32,14]{1,0}", "u32[]{:S(8)}"]
    assert shape_bytes("f32[2,4]{1,0:T(8,128)S(1)}") == 32 and shape_bytes("f32[2,4]{1,0:T(8,128)S(1)}", hbm=True) == 0


# A stacked cache [4, 8, 128] read one [1, 8, 128] layer at a time the way XLA:TPU fuses it (the slice inside a loop
# fusion nested in the output fusion, after a nested layout copy of the whole operand), and one token scattered into
# the stack in place; the loop over key blocks has a data-dependent trip count, named by its scope.
_STACK_READ = """HloModule m

%relayout (r0: f32[4,8,128]) -> f32[4,8,128] {
  %r0 = f32[4,8,128]{2,1,0:T(8,128)} parameter(0)
  ROOT %rc = f32[4,8,128]{2,1,0:T(4,128)} copy(%r0)
}

%one_layer (n0: f32[4,8,128], n1: s32[]) -> f32[8,128] {
  %n0 = f32[4,8,128] parameter(0)
  %n1 = s32[] parameter(1)
  %view = f32[4,8,128]{2,1,0:T(4,128)} fusion(%n0), kind=kLoop, calls=%relayout
  %z = s32[] constant(0)
  %ds = f32[1,8,128] dynamic-slice(%view, %n1, %z, %z), dynamic_slice_sizes={1,8,128}
  ROOT %bc = f32[8,128] bitcast(%ds)
}

%scores (f0: f32[4,8,128], f1: s32[], f2: f32[128,16]) -> f32[8,16] {
  %f0 = f32[4,8,128] parameter(0)
  %f1 = s32[] parameter(1)
  %f2 = f32[128,16] parameter(2)
  %blk = f32[8,128] fusion(%f0, %f1), kind=kLoop, calls=%one_layer
  ROOT %dot = f32[8,16] dot(%blk, %f2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (p: (s32[], f32[4,8,128], f32[128,16])) -> (s32[], f32[4,8,128], f32[128,16]) {
  %p = (s32[], f32[4,8,128], f32[128,16]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %c = f32[4,8,128] get-tuple-element(%p), index=1
  %w = f32[128,16] get-tuple-element(%p), index=2
  %sc = f32[8,16] fusion(%c, %i, %w), kind=kOutput, calls=%scores
  %idx = s32[1,3] constant({{0, 1, 2}})
  %upd = f32[1,128] slice(%sc), slice={[0:1], [0:8]}
  %new = f32[4,8,128] scatter(%c, %idx, %upd), update_window_dims={1}, inserted_window_dims={0,1}, scatter_dims_to_operand_dims={0,1,2}, index_vector_dim=1, to_apply=%add
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[4,8,128], f32[128,16]) tuple(%n, %new, %w)
}

%cond (q: (s32[], f32[4,8,128], f32[128,16])) -> pred[] {
  %q = (s32[], f32[4,8,128], f32[128,16]) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %lim = s32[] get-tuple-element(%q), index=0
  ROOT %lt = pred[] compare(%j, %lim), direction=LT
}

ENTRY %main (a: f32[4,8,128], b: f32[128,16], k: s32[]) -> f32[4,8,128] {
  %a = f32[4,8,128] parameter(0)
  %b = f32[128,16] parameter(1)
  %k = s32[] parameter(2)
  %init = (s32[], f32[4,8,128], f32[128,16]) tuple(%k, %a, %b)
  %w = (s32[], f32[4,8,128], f32[128,16]) while(%init), condition=%cond, body=%body, metadata={op_name="jit(f)/latent_keys/while"}
  ROOT %out = f32[4,8,128] get-tuple-element(%w), index=1
}
"""


def test_slices_through_nested_fusions_and_in_place_scatters_read_only_what_they_touch():
    """A fusion charged for a stacked operand it only slices (through a nested layout-copy fusion and a nested
    slicing fusion, XLA:TPU's shape of a key-block read): one layer, not the stack; a scatter into an operand of its
    result's shape (XLA aliases them) writes and reads only its update. A loop whose trip count depends on the data
    counts once, unless a hint names its scope."""
    layer, stack = 8 * 128 * 4, 4 * 8 * 128 * 4
    once = program_stats(_STACK_READ)
    assert once.unknown_trip_counts == 1 and once.trip_counts == []
    # per trip: the fusion reads one layer of the cache, the layer index and the weight and writes [8, 16]; the
    # slice reads and writes 128 floats; the scatter reads its [1, 128] update and 12 index bytes and writes the
    # update; the counter's add
    per_trip = (layer + 4 + 128 * 16 * 4 + 8 * 16 * 4) + 2 * 128 * 4 + (128 * 4 + 12 + 128 * 4) + 3 * 4
    assert once.bytes_accessed == per_trip < stack
    hinted = program_stats(_STACK_READ, {"latent_keys": 6})
    assert hinted.unknown_trip_counts == 0 and hinted.trip_counts == [6]
    assert hinted.bytes_accessed == 6 * per_trip
    assert program_stats(_STACK_READ, {"other_scope": 6}).unknown_trip_counts == 1


_MULTI_OUTPUT = """HloModule m

%upd (b: f32[8,64,128], x: f32[1,64,128], i: s32[]) -> (f32[8,64,128], f32[1,64,128]) {
  %b = f32[8,64,128] parameter(0)
  %x = f32[1,64,128] parameter(1)
  %i = s32[] parameter(2)
  %y = f32[1,64,128] add(%x, %x)
  %z = s32[] constant(0)
  %d = f32[8,64,128] dynamic-update-slice(%b, %y, %i, %z, %z)
  ROOT %t = (f32[8,64,128], f32[1,64,128]) tuple(%d, %y)
}

ENTRY %main (buf: f32[8,64,128], x: f32[1,64,128], i: s32[]) -> (f32[8,64,128], f32[1,64,128]) {
  %buf = f32[8,64,128] parameter(0)
  %x = f32[1,64,128] parameter(1)
  %i = s32[] parameter(2)
  ROOT %f = (f32[8,64,128], f32[1,64,128]) fusion(%buf, %x, %i), kind=kLoop, calls=%upd
}
"""


def test_multi_output_fusion_updating_a_buffer_in_place():
    """A fusion whose ROOT tuple holds a dynamic-update-slice of its buffer parameter (an AttnRes block-sum commit,
    as XLA:TPU fuses it beside the layer's output): the buffer is neither read nor rewritten — its slot is written,
    from the update the body computes out of its other operands — and the other output is written whole. Where
    the body also reads the buffer (the slot's old value into its update), that slot is read too."""
    one = 64 * 128 * 4
    s = program_stats(_MULTI_OUTPUT)
    # reads: x and the index; the update written once (computed from x: no read of its own); the second output
    assert s.bytes_accessed == (one + 4) + one + one
    rmw = _MULTI_OUTPUT.replace("%y = f32[1,64,128] add(%x, %x)",
                                "%o = f32[1,64,128] dynamic-slice(%b, %i, %z, %z), dynamic_slice_sizes={1,64,128}\n"
                                "  %y = f32[1,64,128] add(%x, %o)").replace("  %z = s32[] constant(0)\n", "")
    rmw = rmw.replace("  %b = f32[8,64,128] parameter(0)\n", "  %b = f32[8,64,128] parameter(0)\n"
                      "  %z = s32[] constant(0)\n")
    assert program_stats(rmw).bytes_accessed == (one + 4) + one + one + one


_SCOPED = """HloModule m

%lib (a: f32[16,32]) -> f32[16,16] {
  %a = f32[16,32] parameter(0)
  ROOT %d = f32[16,16] dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

ENTRY %main (x: f32[16,32], w: f32[32,8]) -> (f32[16,16], f32[16,8], f32[16,16]) {
  %x = f32[16,32] parameter(0)
  %w = f32[32,8] parameter(1)
  %n = f32[16,32] multiply(%x, %x), metadata={op_name="jit(step)/optimizer_update/muon_newton_schulz/mul"}
  %g = f32[16,16] fusion(%n), kind=kCustom, calls=%lib
  %h = f32[16,8] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit/dot"}
  %r = f32[16,16] all-reduce(%g), replica_groups={}, to_apply=%lib
  ROOT %t = (f32[16,16], f32[16,8], f32[16,16]) tuple(%g, %h, %r)
}
"""


def test_named_scopes_reach_instructions_that_lost_their_metadata():
    """XLA:CPU's library fusions drop op_name metadata: a fusion without it takes its operands' scope, and its
    body's dot the fusion's; an instruction with metadata outside the scope stays outside."""
    s = program_stats(_SCOPED, scopes=("muon_newton_schulz", "optimizer_update", "absent"))
    ns = s.scoped["muon_newton_schulz"]
    assert ns["flops"] == 2 * 16 * 16 * 32  # the fused dot, not the model's [16, 32] x [32, 8]
    assert s.flops == ns["flops"] + 2 * 16 * 8 * 32
    assert ns["collectives"] == {"all-reduce": {"count": 1, "bytes": 16 * 16 * 4}}
    assert s.scoped["optimizer_update"] == ns and s.scoped["absent"] == {"flops": 0.0, "collectives": {}}
