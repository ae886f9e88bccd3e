"""kvarn_kernels._launch: the direct-launch cache, with a stand-in for a JIT kernel (CPU).

The real launcher runs in the GPU tests of every op that launches through it (rotation, the
dequantize path); here the cache's decisions are checked: which calls go through the JIT,
which reach the compiled kernel's launcher, and with which arguments.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from triton.backends.compiler import BaseBackend  # type: ignore[import-untyped]

from kvarn_kernels import _launch


def _kernel_fn(X, n, scale, A, B):  # type: ignore[no-untyped-def]
    """The stand-in kernel's signature: three runtime parameters, then two constexprs."""


class _Compiled:
    function = "fn-handle"
    packed_metadata = "meta"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def run(self, *a: Any) -> None:
        self.calls.append(a)


class _Param:
    def __init__(self, name: str) -> None:
        self.is_constexpr = name in ("A", "B")
        self.is_const = False
        self.do_not_specialize = False
        self.do_not_specialize_on_alignment = False


class _Kernel:
    """Records ``kernel[grid](...)`` calls; every call 'compiles' the same binary. Specializes
    its arguments with Triton's base backend (what the JIT's CPU-side type mangling uses)."""

    fn = staticmethod(_kernel_fn)

    def __init__(self) -> None:
        self.params = [_Param(n) for n in ("X", "n", "scale", "A", "B")]
        self.device_caches = {0: (None, None, None, BaseBackend, None)}
        self.jit_calls: list[tuple[Any, ...]] = []
        self.compiled = _Compiled()

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def call(*args: Any, **kw: Any) -> _Compiled:
            self.jit_calls.append((grid, args, kw))
            return self.compiled

        return call


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_launch, "_COMPILED", {})
    monkeypatch.setattr(_launch, "_UNWRAPPED", {})
    monkeypatch.setattr(_launch, "_ENCODED", {})
    monkeypatch.setattr(_launch, "triton_interpret", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_raw_stream", lambda dev: 1234)


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every argument ``_launch`` specializes, in order (Triton's function still does it)."""
    args: list[object] = []
    real = _launch.native_specialize_impl

    def counting(backend: Any, arg: object, *flags: bool) -> Any:
        args.append(arg)
        return real(backend, arg, *flags)

    monkeypatch.setattr(_launch, "native_specialize_impl", counting)
    return args


def test_second_call_goes_to_the_launcher(fresh: None) -> None:
    k = _Kernel()
    x = torch.zeros(64)
    _launch.launch(k, (3,), (x, 7, 0.5), {"B": 2, "A": 1}, num_warps=4)
    assert len(k.jit_calls) == 1 and not k.compiled.calls
    _launch.launch(k, (5, 2), (x, 7, 0.25), {"B": 2, "A": 1}, num_warps=4)
    assert len(k.jit_calls) == 1
    (call,) = k.compiled.calls
    # grid padded to 3-D, the stream, the handles, no metadata or hooks, then every parameter
    # in signature order (constexprs after the runtime ones, in the signature's order)
    assert call == (5, 2, 1, 1234, "fn-handle", "meta", None, None, None, x, 7, 0.25, 1, 2)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"n": 7}, {"n": 1}),  # an int equal to 1 is a constant to Triton
        ({"n": 7}, {"n": 32}),  # divisible by 16
        ({"n": 7}, {"n": 1 << 40}),  # 64-bit
        ({"offset": 0}, {"offset": 2}),  # a pointer not 16-byte aligned
        ({"dtype": torch.float32}, {"dtype": torch.float16}),
        ({"A": 1}, {"A": 2}),  # another constexpr value
        ({"warps": 4}, {"warps": 8}),
        ({"stages": None}, {"stages": 2}),  # launch options: Triton's default, then given
        ({"stages": 2}, {"stages": 3}),
        ({"maxnreg": None}, {"maxnreg": 128}),
    ],
)
def test_a_new_specialization_goes_through_the_jit(
    fresh: None, first: dict[str, Any], second: dict[str, Any]
) -> None:
    k = _Kernel()
    base = torch.zeros(64)

    def call(
        n: int = 7,
        offset: int = 0,
        dtype: torch.dtype = torch.float32,
        A: int = 1,
        warps: int = 4,
        stages: int | None = None,
        maxnreg: int | None = None,
    ) -> None:
        x = base.to(dtype)[offset:]
        _launch.launch(
            k,
            (1,),
            (x, n, 0.5),
            {"A": A, "B": 2},
            num_warps=warps,
            num_stages=stages,
            maxnreg=maxnreg,
        )

    call(**first)
    call(**second)
    assert len(k.jit_calls) == 2 and not k.compiled.calls
    # the JIT got the launch options that were given, and no others
    options = {"num_warps": "warps", "num_stages": "stages", "maxnreg": "maxnreg"}
    for (_grid, _args, kw), given in zip(k.jit_calls, (first, second), strict=True):
        want = {"warps": 4, "stages": None, "maxnreg": None, **given}
        got = {o: kw.get(o) for o in options}
        assert got == {o: want[name] for o, name in options.items()}
    call(**second)  # now known
    assert len(k.jit_calls) == 2 and len(k.compiled.calls) == 1


def test_descriptor_arguments_are_specialized_once_per_object(
    fresh: None, seen: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``launch(..., descriptors=1)``: the last argument's specialization is computed on its
    first call only (the caller reuses the object), and the key is the one the per-call form
    computes, so the second call still reaches the launcher; a new object (another cache's
    descriptor) is specialized again."""
    monkeypatch.setattr(_launch, "_DESCRIPTOR_SPECS", {})
    k = _Kernel()
    x = torch.zeros(64)
    desc, other = torch.zeros(32), torch.zeros(32)  # stand-ins: any object specializes
    plain = _launch.launch_key(k, (x, 7, desc), {"B": 2, "A": 1}, {"num_warps": 4})
    seen.clear()
    for _ in range(3):
        _launch.launch(k, (1,), (x, 7, desc), {"B": 2, "A": 1}, num_warps=4, descriptors=1)
    assert sum(a is desc for a in seen) == 1 and sum(a is x for a in seen) == 3
    assert len(k.jit_calls) == 1 and len(k.compiled.calls) == 2
    key = _launch.launch_key(k, (x, 7, desc), {"B": 2, "A": 1}, {"num_warps": 4}, 1)
    assert key == plain
    _launch.launch(k, (1,), (x, 7, other), {"B": 2, "A": 1}, num_warps=4, descriptors=1)
    assert sum(a is other for a in seen) == 1


class _DescriptorRun:
    """A stand-in for Triton 3.6's ``CudaLauncher`` of the stand-in kernel with a tensor
    descriptor as its third runtime parameter: its ``launch`` is Triton's own descriptor
    wrapper (``wrap_handle_tensordesc``) around a recorder of what reaches the launcher
    module."""

    global_scratch_size = 0
    profile_scratch_size = 0
    launch_cooperative_grid = False
    launch_pdl = True

    def __init__(self, meta: object) -> None:
        from triton.backends.nvidia import driver  # type: ignore[import-untyped]

        self.module_calls: list[tuple[Any, ...]] = []
        signature = {0: "*fp32", 1: "i32", 2: "tensordesc<fp16[64, 64]>"}
        signature |= {3: "constexpr", 4: "constexpr"}
        self.launch = driver.wrap_handle_tensordesc(self._module_launch, signature, [meta])

    def _module_launch(self, *a: Any) -> None:
        self.module_calls.append(a)

    def __call__(self, gx: int, gy: int, gz: int, stream: int, function: Any, *a: Any) -> None:
        # as CudaLauncher.__call__: the launch flags and (no) scratch buffers go first
        self.launch(gx, gy, gz, stream, function, False, True, None, None, *a)


def test_descriptors_are_encoded_once_per_object(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``launch(..., descriptors=1)`` on a compiled kernel with a tensor descriptor: the
    launcher module gets exactly the arguments Triton's wrapper builds, but the descriptor's
    ``CUtensorMap`` is encoded on its first launch only (a new object is encoded again)."""
    from triton.backends.nvidia import driver

    encodings: list[object] = []

    def encode(desc: object, meta: object) -> list[object]:
        encodings.append(desc)
        return [("tensor map of", id(desc)), 64, 64, 1]

    monkeypatch.setattr(driver, "make_tensordesc_arg", encode)
    k = _Kernel()
    run = _DescriptorRun({"swizzle": 128})
    k.compiled.run = run  # type: ignore[assignment, method-assign]
    x, desc, other = torch.zeros(64), torch.zeros(32), torch.zeros(32)  # stand-ins

    def go(d: object) -> None:
        _launch.launch(k, (2,), (x, 7, d), {"A": 1, "B": 2}, num_warps=4, descriptors=1)

    go(desc)  # a new key: through the JIT
    assert len(k.jit_calls) == 1 and not run.module_calls
    # Triton's own wrapper, for reference (it encodes on every call)
    run(2, 1, 1, 1234, "fn-handle", "meta", None, None, None, x, 7, desc, 1, 2)
    (expected,) = run.module_calls
    assert expected[13:] == (x, 7, ("tensor map of", id(desc)), 64, 64, 1, 1, 2)
    for _ in range(3):
        go(desc)
    assert run.module_calls == [expected] * 4
    assert encodings == [desc, desc]  # Triton's wrapper's, then one for the three launches
    go(other)
    assert run.module_calls[-1] == (*expected[:15], ("tensor map of", id(other)), *expected[16:])
    assert encodings[-1] is other and len(encodings) == 3


def test_descriptor_launchers_of_another_shape_keep_tritons_path(fresh: None) -> None:
    """A compiled kernel whose launcher is not Triton 3.6's descriptor wrapper (another
    Triton, scratch memory to allocate) is launched through ``compiled.run`` as before."""
    k = _Kernel()
    x, desc = torch.zeros(64), torch.zeros(32)
    for _ in range(2):
        _launch.launch(k, (1,), (x, 7, desc), {"A": 1, "B": 2}, num_warps=4, descriptors=1)
    assert len(k.compiled.calls) == 1 and _launch._UNWRAPPED[k.compiled] is None


def test_signatures_not_matched_stay_on_the_jit(fresh: None) -> None:
    k = _Kernel()
    x = torch.zeros(4)
    for _ in range(2):  # constexprs that are not the signature's tail (B left to a default)
        _launch.launch(k, (1,), (x, 3, 0.5), {"A": 1}, num_warps=4)
    assert len(k.jit_calls) == 2 and not k.compiled.calls


def test_interpreter_always_takes_the_jit(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_launch, "triton_interpret", lambda: True)
    k = _Kernel()
    x = torch.zeros(4)
    for _ in range(3):
        _launch.launch(k, (1,), (x, 3, 0.5), {"A": 1, "B": 2}, num_warps=4)
    assert len(k.jit_calls) == 3 and not _launch._COMPILED


def test_replacing_specializes_only_the_replaced_arguments(fresh: None, seen: list[object]) -> None:
    """``PreparedLaunch.run_replacing``: once the prepared arguments have compiled, a call
    with other tensors of the same specialization reaches the compiled kernel's launcher with
    them in place, specializing only those (no key built); a replacement that specializes
    otherwise (here a pointer not 16-byte aligned) goes through ``launch()`` and so the JIT,
    and comes back to the launcher with its own compiled kernel from then on."""
    k = _Kernel()
    x, other = torch.zeros(64), torch.zeros(64)
    prepared = _launch.PreparedLaunch(k, (2,), (x, 7, 0.5), {"A": 1, "B": 2}, 4)
    prepared.run_replacing({})  # not compiled yet: through the JIT
    assert len(k.jit_calls) == 1 and not k.compiled.calls
    seen.clear()
    prepared.run_replacing({0: other})
    prepared.run_replacing({0: other})
    # bound once (the prepared arguments' key: three), then only the replaced tensor
    assert seen == [x, 7, 0.5, other, other]
    assert len(k.jit_calls) == 1
    assert [c[9:] for c in k.compiled.calls] == [(other, 7, 0.5, 1, 2)] * 2
    unaligned = torch.zeros(65)[1:]
    prepared.run_replacing({0: unaligned})
    assert len(k.jit_calls) == 2 and k.jit_calls[-1][1] == (unaligned, 7, 0.5)
    prepared.run_replacing({0: unaligned})  # now compiled under its own key
    assert len(k.jit_calls) == 2 and k.compiled.calls[-1][9] is unaligned


def test_replacing_keeps_the_jit_where_launch_does(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run_replacing`` takes ``launch()``'s path for a kernel that always goes through the
    JIT (a signature it does not match), under the interpreter, and with launch hooks
    installed (a profiler's), and launches nothing for an empty grid."""
    k = _Kernel()
    x, other = torch.zeros(4), torch.zeros(4)
    jit_only = _launch.PreparedLaunch(k, (1,), (x, 3, 0.5), {"A": 1}, 4)  # B left to a default
    for _ in range(3):
        jit_only.run_replacing({0: other})
    assert len(k.jit_calls) == 3 and not k.compiled.calls
    assert jit_only._bound == [None]  # known to stay on the JIT, not looked up again
    prepared = _launch.PreparedLaunch(k, (1,), (x, 3, 0.5), {"A": 1, "B": 2}, 4)
    prepared.run_replacing({})
    monkeypatch.setattr(_launch, "_hooks_installed", lambda: True)
    prepared.run_replacing({0: other})
    assert len(k.jit_calls) == 5 and not k.compiled.calls
    monkeypatch.setattr(_launch, "_hooks_installed", lambda: False)
    monkeypatch.setattr(_launch, "triton_interpret", lambda: True)
    prepared.run_replacing({0: other})
    assert len(k.jit_calls) == 6 and not k.compiled.calls
    _launch.PreparedLaunch(k, (0, 4), (x, 3, 0.5), {"A": 1, "B": 2}, 4).run_replacing({})
    assert len(k.jit_calls) == 6


@pytest.mark.gpu
def test_direct_launches_compute_what_the_jit_does(device: torch.device) -> None:
    """On the GPU: a rotation launched again with one specialization reaches the compiled
    kernel's launcher (the cache holds it) and is right each time, for new inputs at other
    addresses, an odd row count and a misaligned view (a second specialization)."""
    from kvarn_format.hadamard import hadamard_matrix
    from kvarn_kernels.rotation import _rotate_rows_kernel, rotate_into

    d = 128
    h = torch.tensor(hadamard_matrix(d), dtype=torch.float64, device=device)
    for rows, offset in ((64, 0), (64, 0), (37, 0), (37, 0), (36, 1), (36, 1)):
        x = torch.randn(rows * d + offset, device=device).half()[offset:].view(rows, d)
        y = torch.empty(rows, d, device=device, dtype=torch.float16)
        rotate_into(x, y, 0.5)
        want = (0.5 * x.double() @ h).half()
        torch.testing.assert_close(y, want, atol=2e-3, rtol=2e-3)
    keys = [k for k in _launch._COMPILED if k[0] is _rotate_rows_kernel]
    assert keys and all(_launch._COMPILED[k] is not None for k in keys)


def test_every_launch_lists_its_whole_signature(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each op's launches pass every constexpr of their kernel (defaults too), so that
    :func:`kvarn_kernels._launch._tail` matches and a GPU's second call takes the direct path:
    a launch that leaves one to its default stays on the JIT, correct and ~10 µs slower. Runs
    the store (through the case's encoder), every decode variant that takes the case, verify,
    and both prefill methods with their fused kernels; on the CPU under the interpreter, on a
    GPU with Gluon's variants (decode v5/v6, prefill v3) as well."""
    import kvarn_kernels.attention as attention
    import kvarn_kernels.context as context
    import kvarn_kernels.store as store
    from kvarn_kernels import decode_attention, prefill_attention, verify_attention
    from kvarn_kernels.testing import build_case

    calls: list[tuple[Any, int, dict[str, object]]] = []
    real = _launch.launch

    def spy(kernel: Any, grid: Any, args: Any, constexprs: Any, **kw: Any) -> None:
        calls.append((kernel, len(args), dict(constexprs)))
        real(kernel, grid, args, constexprs, **kw)

    # the modules that launch by name, and the prepared launches (rotation, fused prefill)
    for module in (_launch, attention, context, store):
        monkeypatch.setattr(module, "launch", spy)
    gpu = device.type == "cuda"
    name, d, hq, hk = "kvarn_k4v2_g64", 128 if gpu else 64, 8, 2
    lens, qlens = [200, 70], [3, 2]
    case = build_case(name, d, hk, lens, device=device, seed=5)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(1)).half()
    args = case.decode_args(name, q.to(device), 0.125)
    variants = ["v1", "v4", "v4b", "v4c", "v4d"] + (
        ["v5", "v5f", "v6", "v6f", "v6t"] if gpu else []
    )
    for variant in variants:
        decode_attention(*args, variant=variant)
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32, device=device)
    qp = torch.randn(sum(qlens), hq, d, generator=torch.Generator().manual_seed(2)).half()
    pargs = case.prefill_args(name, qp.to(device), qsl, 0.125)
    verify_attention(*pargs, max_query_len=3)
    prefill_attention(*pargs)
    for kernel in ("v1", "v2", *(("v3",) if gpu else ())):
        prefill_attention(*pargs, method="fused", fused_kernel=kernel)
    launched = {k.fn.__name__ for k, _n, _c in calls}
    assert {"_attn_kernel", "decode_v4_kernel", "decode_pool_kernel"} <= launched
    partial = sorted({k.fn.__name__ for k, n, c in calls if _launch._tail(k, n, c) is None})
    assert not partial, f"launches that leave constexprs to their defaults: {partial}"
