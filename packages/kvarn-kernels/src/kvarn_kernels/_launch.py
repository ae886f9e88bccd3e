"""Kernel launches that skip the Triton JIT's per-call work once a kernel is compiled.

``kernel[grid](*args, **constexprs)`` binds every argument, builds Triton's specialization
key, checks the kernel's globals and prepares launch metadata before it reaches the compiled
binary's launcher: 15-30 µs of host time per launch on an H200 host
(docs/kernel-notes.md, twenty-fifth session). vLLM runs prefill-with-context attention outside
CUDA graphs, once per layer, so that time is paid by every layer of every step with a
continuation chunk.

:func:`launch` keeps the compiled kernel of each specialization under a key of its own that
determines Triton's specialization: the constexpr values, ``num_warps``, the current device,
and each runtime argument's specialization computed by the JIT's own native function (a
tensor's dtype and 16-byte alignment, an int's equality to 1, divisibility by 16 and width).
A new key goes through the JIT (which compiles if needed and launches), and its compiled
kernel is kept; a known key calls the launcher directly. Two calls with one key thus get the
one binary Triton would have picked. The launch options ``num_warps``, ``num_stages``,
``maxnreg`` and ``launch_pdl`` are part of the key. Under the interpreter, with a launch hook
installed (profilers) or for a signature that does not list its runtime parameters first,
every call takes the JIT's path. A kernel taking tensor descriptors the caller keeps (v6t's)
gets them encoded once per object, not by Triton's launcher wrapper on every call
(:class:`_DescriptorLauncher`). :class:`PreparedLaunch` holds one launch's grid, arguments
and constexprs for a caller that repeats it with other tensors (the per-step plans:
:mod:`kvarn_kernels.fused_prefill`, :mod:`kvarn_kernels.decode_batch`,
:class:`kvarn_kernels.SidePoolWritePlan`); once compiled, it specializes only the arguments
a layer replaces.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, cast

import torch
from triton import knobs  # type: ignore[import-untyped]
from triton._C.libtriton import native_specialize_impl  # type: ignore[import-untyped]
from triton.experimental import gluon  # type: ignore[import-untyped]
from triton.experimental.gluon import language as gl  # type: ignore[import-untyped]

from kvarn_kernels._common import triton_interpret

__all__ = [
    "PROGRAMMATIC_LAUNCH",
    "PreparedLaunch",
    "gdc_wait",
    "launch",
    "launch_key",
    "pdl_supported",
]

#: Launch the kernels written for it as programmatic dependents of the kernel before them
#: (:func:`pdl_supported`): each starts, up to its wait, while its predecessor drains. Off:
#: correct (``test_programmatic_launch_gpu`` passed on an H100) but not worth it there, graph
#: replay 0.99-1.00x of plain launches for the fused prefill and 0.986x at best for decode
#: at B = 1 (``scripts/pdl_ab.py``, docs/kernel-notes.md, forty-fifth session).
PROGRAMMATIC_LAUNCH = False

#: key -> (compiled kernel, the constexpr values in signature order), or None where a kernel
#: always takes the JIT's path
_COMPILED: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...]] | None] = {}
_NEW = object()
#: kernel -> per runtime parameter: (is_const, specialize, specialize on alignment)
_FLAGS: dict[Any, tuple[tuple[bool, ...], tuple[bool, ...], tuple[bool, ...]]] = {}


def _flags(kernel: Any) -> tuple[tuple[bool, ...], tuple[bool, ...], tuple[bool, ...]]:
    flags = _FLAGS.get(kernel)
    if flags is None:
        runtime = [p for p in kernel.params if not p.is_constexpr]
        flags = (
            tuple(bool(p.is_const) for p in runtime),
            tuple(not p.do_not_specialize for p in runtime),
            tuple(not p.do_not_specialize_on_alignment for p in runtime),
        )
        _FLAGS[kernel] = flags
    return flags


def launch_key(
    kernel: Any,
    args: Sequence[object],
    constexprs: Mapping[str, object],
    options: Mapping[str, int],
    descriptors: int = 0,
) -> tuple[Any, ...]:
    """The cache key of a launch: the kernel, its launch options (``num_warps`` and those
    given of ``num_stages`` and ``maxnreg``), the current device, the constexprs, and each
    runtime argument's specialization as the JIT computes it (Triton's own native function,
    mapped in C over the arguments; the last ``descriptors`` arguments' once per object, see
    :func:`launch`)."""
    dev = torch.cuda.current_device()
    backend = kernel.device_caches[dev][3]
    is_const, specialize, align = _flags(kernel)
    if descriptors:
        n = len(args) - descriptors
        flags = zip(args[n:], is_const[n:], specialize[n:], align[n:], strict=False)
        specs = tuple(
            map(native_specialize_impl, repeat(backend), args[:n], is_const, specialize, align)
        ) + tuple(_descriptor_spec(backend, *f) for f in flags)
    else:
        specs = tuple(
            map(native_specialize_impl, repeat(backend), args, is_const, specialize, align)
        )
    return (kernel, tuple(options.items()), dev, tuple(constexprs.items()), specs)


#: id -> (descriptor, backend, flags, its specialization). Triton formats a tensor
#: descriptor's block shape and layout into its specialization on every call (~2 µs a
#: descriptor on the CI host, ~4 on an H100's: forty-third session); a descriptor the caller
#: keeps for its cache's lifetime (v6t's four) is formatted once. The entry holds the object,
#: so its id is not reused while the entry lives; cleared past :data:`_DESCRIPTOR_SPECS_MAX`.
_DESCRIPTOR_SPECS: dict[int, tuple[object, Any, tuple[bool, bool, bool], Any]] = {}
_DESCRIPTOR_SPECS_MAX = 4096


def _descriptor_spec(backend: Any, arg: object, is_const: bool, spec: bool, align: bool) -> Any:
    flags = (is_const, spec, align)
    hit = _DESCRIPTOR_SPECS.get(id(arg))
    if hit is not None and hit[0] is arg and hit[1] is backend and hit[2] == flags:
        return hit[3]
    value = native_specialize_impl(backend, arg, is_const, spec, align)
    if len(_DESCRIPTOR_SPECS) >= _DESCRIPTOR_SPECS_MAX:
        _DESCRIPTOR_SPECS.clear()
    _DESCRIPTOR_SPECS[id(arg)] = (arg, backend, flags, value)
    return value


def _tail(kernel: Any, n_args: int, constexprs: Mapping[str, object]) -> tuple[Any, ...] | None:
    """The constexpr values in signature order, when the signature lists exactly ``n_args``
    runtime parameters first and then exactly the given constexprs; else None."""
    names = list(inspect.signature(kernel.fn).parameters)
    tail = names[n_args:]
    if len(names) < n_args or set(tail) != set(constexprs):
        return None
    return tuple(constexprs[n] for n in tail)


def pdl_supported(device: torch.device) -> bool:
    """Whether a launch on ``device`` may be a programmatic dependent one: sm_90 or newer,
    compiled (not the interpreter), and :data:`PROGRAMMATIC_LAUNCH` on."""
    if not PROGRAMMATIC_LAUNCH or device.type != "cuda" or triton_interpret():
        return False
    return _sm_major(torch.cuda.current_device() if device.index is None else device.index) >= 9


@functools.cache
def _sm_major(index: int) -> int:
    return int(torch.cuda.get_device_capability(index)[0])


@gluon.jit
def gdc_wait():  # type: ignore[no-untyped-def]
    """In a Gluon kernel: wait for the kernel before this one on the stream to finish and its
    writes to be visible. A kernel launched as a programmatic dependent (``launch(...,
    pdl=True)``) may start before its predecessor ends and must pass this before it reads
    what that one wrote (Triton kernels: ``triton.language.extra.cuda.gdc_wait``). A no-op in
    a kernel launched plainly."""
    gl.inline_asm_elementwise(
        "griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


def _hooks_installed() -> bool:
    """True when a launch hook is installed (a profiler's): those calls keep the JIT's path,
    which builds the metadata hooks read. Triton 3.6 keeps the hooks as (usually empty)
    chains; older versions as a callable or None."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(getattr(h, "calls", h is not None) for h in hooks)


def _current_device() -> int:
    """``torch.cuda.current_device()`` without its lazy-init checks (CUDA is initialized
    wherever a kernel has compiled: the only callers)."""
    get = getattr(torch._C, "_cuda_getDevice", None)
    return int(get()) if get is not None else torch.cuda.current_device()


def _raw_stream(dev: int) -> int:
    """The current CUDA stream's handle, as Triton's driver reads it."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return int(get(dev)) if get is not None else int(torch.cuda.current_stream(dev).cuda_stream)


def launch(
    kernel: Any,
    grid: tuple[int, ...],
    args: Sequence[object],
    constexprs: Mapping[str, object],
    *,
    num_warps: int,
    num_stages: int | None = None,
    maxnreg: int | None = None,
    pdl: bool = False,
    descriptors: int = 0,
) -> None:
    """``kernel[grid](*args, **constexprs, num_warps=num_warps, ...)``, through the compiled
    kernel's launcher when a call with the same key has compiled it. ``args`` are the
    kernel's leading runtime parameters in order, ``constexprs`` all the rest by name;
    ``num_stages`` and ``maxnreg``: Triton's launch options of those names, left to
    Triton's defaults when None. ``pdl``: a programmatic dependent launch (Triton's
    ``launch_pdl``; see :func:`pdl_supported`): the kernel may start while the one before it
    on the stream finishes, so it must wait (``griddepcontrol.wait``) before reading what
    that one wrote or writing what it reads. ``descriptors``: the last that many of ``args``
    are tensor descriptors the caller reuses from call to call (never changed once made):
    their specialization is computed once per object."""
    options = _options(num_warps, num_stages, maxnreg, pdl)
    if triton_interpret() or _hooks_installed():
        kernel[grid](*args, **constexprs, **options)
        return
    key = launch_key(kernel, args, constexprs, options, descriptors)
    hit = _COMPILED.get(key, _NEW)
    if hit is _NEW:
        compiled = kernel[grid](*args, **constexprs, **options)
        tail = _tail(kernel, len(args), constexprs)
        _COMPILED[key] = None if tail is None or compiled is None else (compiled, tail)
        return
    if hit is None:
        kernel[grid](*args, **constexprs, **options)
        return
    compiled, tail = cast(tuple[Any, tuple[Any, ...]], hit)
    _run_compiled(compiled, tail, key[2], grid, args, descriptors)


def _options(
    num_warps: int, num_stages: int | None, maxnreg: int | None, pdl: bool
) -> dict[str, int]:
    """The launch options of a key (:func:`launch_key`): those given, by Triton's names."""
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    if pdl:
        options["launch_pdl"] = True
    return options


def _run_compiled(
    compiled: Any,
    tail: tuple[Any, ...],
    dev: int,
    grid: tuple[int, ...],
    args: Sequence[object],
    descriptors: int,
) -> None:
    """Launch ``compiled`` on device ``dev``'s current stream through its launcher (the
    direct descriptor path where it applies), as the JIT would have."""
    stream = _raw_stream(dev)
    gx = grid[0]
    gy = grid[1] if len(grid) > 1 else 1
    gz = grid[2] if len(grid) > 2 else 1
    if descriptors:
        direct = _descriptor_launcher(compiled, len(args) - descriptors, descriptors)
        if direct is not None:
            direct.launch(gx, gy, gz, stream, compiled, args, tail)
            return
    compiled.run(
        gx,
        gy,
        gz,
        stream,
        compiled.function,
        compiled.packed_metadata,
        None,
        None,
        None,
        *args,
        *tail,
    )


@dataclass(frozen=True)
class _DescriptorLauncher:
    """A compiled kernel's launcher module, called with its tensor descriptors encoded once.

    Triton 3.6 wraps the launcher of a kernel that takes tensor descriptors in a Python loop
    over every argument that encodes each descriptor's ``CUtensorMap`` on every call
    (``wrap_handle_tensordesc`` -> ``make_tensordesc_arg`` -> ``fill_tma_descriptor``): ~9 µs
    for v6t's four on an H100 host, plus the loop (docs/kernel-notes.md, forty-third
    session). A descriptor the caller keeps (v6t's, one set per cache) encodes to the same
    bytes every time, so its encoding is kept with the object (:data:`_ENCODED`) and the
    launcher gets the arguments Triton's wrapper would have built."""

    raw: Any  # the compiled launcher module's ``launch``
    cooperative: bool
    pdl: bool
    metas: tuple[Any, ...]  # Triton's per-descriptor encoding metadata (or None)

    def launch(
        self,
        gx: int,
        gy: int,
        gz: int,
        stream: int,
        compiled: Any,
        args: Sequence[object],
        tail: tuple[Any, ...],
    ) -> None:
        first = len(args) - len(self.metas)
        encoded: list[object] = []
        for desc, meta in zip(args[first:], self.metas, strict=True):
            encoded.extend(_encoded(desc, meta))
        self.raw(
            gx,
            gy,
            gz,
            stream,
            compiled.function,
            self.cooperative,
            self.pdl,
            None,  # no global scratch (checked when the launcher was unwrapped)
            None,  # no profile scratch
            compiled.packed_metadata,
            None,  # launch metadata: hooks are not installed on this path
            None,
            None,
            *args[:first],
            *encoded,
            *tail,
        )


#: compiled kernel -> its :class:`_DescriptorLauncher`, or None where the launcher is not
#: the shape this module knows (it then keeps Triton's wrapper)
_UNWRAPPED: dict[Any, _DescriptorLauncher | None] = {}


def _descriptor_launcher(compiled: Any, first: int, count: int) -> _DescriptorLauncher | None:
    """The direct launcher of ``compiled``, whose arguments ``first`` to ``first + count``
    are its only tensor descriptors; None (Triton's own path) unless the launcher is Triton
    3.6's ``CudaLauncher`` around ``wrap_handle_tensordesc``'s wrapper with exactly those
    descriptor positions and no scratch memory to allocate."""
    if compiled in _UNWRAPPED:
        return _UNWRAPPED[compiled]
    direct = None
    run = compiled.run
    wrapper = getattr(run, "launch", None)
    cells = dict(
        zip(
            getattr(getattr(wrapper, "__code__", None), "co_freevars", ()),
            getattr(wrapper, "__closure__", None) or (),
            strict=True,
        )
    )
    try:
        raw = cells["launcher"].cell_contents
        positions = cells["tensordesc_indices"].cell_contents
        metas = tuple(cells["tensordesc_meta"].cell_contents)
    except (KeyError, ValueError):
        raw = None
    if (
        raw is not None
        and set(positions) == set(range(first, first + count))
        and len(metas) == count
        and not run.global_scratch_size
        and not run.profile_scratch_size
    ):
        direct = _DescriptorLauncher(raw, run.launch_cooperative_grid, run.launch_pdl, metas)
    _UNWRAPPED[compiled] = direct
    return direct


#: id -> (descriptor, its encoding metadata, the arguments it expands to); bounded and
#: holding the objects as :data:`_DESCRIPTOR_SPECS` does
_ENCODED: dict[int, tuple[object, Any, list[object]]] = {}


def _encoded(desc: object, meta: Any) -> list[object]:
    hit = _ENCODED.get(id(desc))
    if hit is not None and hit[0] is desc and hit[1] is meta:
        return hit[2]
    from triton.backends.nvidia import driver  # type: ignore[import-untyped]

    value = list(driver.make_tensordesc_arg(desc, meta))
    if len(_ENCODED) >= _DESCRIPTOR_SPECS_MAX:
        _ENCODED.clear()
    _ENCODED[id(desc)] = (desc, meta, value)
    return value


@dataclass(frozen=True)
class _Bound:
    """A prepared launch's compiled kernel, from its own arguments' key: the device, the
    compiled kernel and its constexpr tail, and each runtime argument's specialization."""

    dev: int
    compiled: Any
    tail: tuple[Any, ...]
    specs: tuple[Any, ...]
    backend: Any  # the kernel's compile backend on ``dev`` (what specializes an argument)
    flags: tuple[tuple[bool, ...], tuple[bool, ...], tuple[bool, ...]]  # :func:`_flags`


@dataclass(frozen=True)
class PreparedLaunch:
    """One :func:`launch` with its grid, arguments, constexprs and options worked out, so that
    a caller repeating it (a step's layers) pays only the launch."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[object, ...]
    constexprs: Mapping[str, object]
    num_warps: int
    num_stages: int | None = None
    maxnreg: int | None = None
    pdl: bool = False
    #: the last that many of :attr:`args` are tensor descriptors (:func:`launch`)
    descriptors: int = 0
    #: the :class:`_Bound` of :attr:`args`, once known (:meth:`run_replacing`)
    _bound: list[_Bound | None] = field(default_factory=list, init=False, repr=False, compare=False)

    def run(self, args: Sequence[object] | None = None) -> None:
        """Launch it, with ``args`` in place of :attr:`args` when given (the same parameters,
        e.g. another layer's tensors of the same shapes); an empty grid launches nothing."""
        if 0 in self.grid:
            return
        launch(
            self.kernel,
            self.grid,
            self.args if args is None else args,
            self.constexprs,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
            maxnreg=self.maxnreg,
            pdl=self.pdl,
            descriptors=self.descriptors,
        )

    def run_replacing(self, replacements: Mapping[int, object]) -> None:
        """:meth:`run` with :attr:`args` but the arguments at the positions ``replacements``
        maps (another layer's tensors of the same layout). Once :attr:`args` have compiled,
        only the replaced arguments' specializations are computed: where each equals the one
        it replaces, the key would be :attr:`args`' own, so the launch goes to that compiled
        kernel without building the key (a decode call's four launches, each layer of a
        step); else it is an ordinary :func:`launch`."""
        if 0 in self.grid:
            return
        args = list(self.args)
        for i, a in replacements.items():
            args[i] = a
        bound = self._bound[0] if self._bound else self._bind()
        if (
            bound is None
            or triton_interpret()
            or _hooks_installed()
            or _current_device() != bound.dev
        ):
            self.run(args)
            return
        backend = bound.backend
        is_const, specialize, align = bound.flags
        first_descriptor = len(args) - self.descriptors
        for i in replacements:
            spec = native_specialize_impl if i < first_descriptor else _descriptor_spec
            if spec(backend, args[i], is_const[i], specialize[i], align[i]) != bound.specs[i]:
                self.run(args)
                return
        _run_compiled(bound.compiled, bound.tail, bound.dev, self.grid, args, self.descriptors)

    def _bind(self) -> _Bound | None:
        """The compiled kernel of :attr:`args`' key, kept (None, also kept, for a kernel that
        always takes the JIT's path); None while it has not compiled, or while
        :func:`launch` takes the JIT's path (the interpreter, a profiler's hooks)."""
        if triton_interpret() or _hooks_installed():
            return None
        options = _options(self.num_warps, self.num_stages, self.maxnreg, self.pdl)
        key = launch_key(self.kernel, self.args, self.constexprs, options, self.descriptors)
        hit = _COMPILED.get(key, _NEW)
        if hit is _NEW:  # not compiled yet: bind on a later call
            return None
        bound = (
            None
            if hit is None
            else _Bound(
                key[2],
                *cast(tuple[Any, Any], hit),
                key[4],
                self.kernel.device_caches[key[2]][3],
                _flags(self.kernel),
            )
        )
        self._bound.append(bound)
        return bound
