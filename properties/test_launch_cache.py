"""The plans of ``fuseaudit/kernels/_launch.py``: the same results as Triton's own path, never kept when interpreted."""

from __future__ import annotations

import pytest
import torch

from fuseaudit.kernels import _launch
from fuseaudit.kernels.rms_norm import add_rms_norm, rms_norm


def _inputs(device: str, n: int, *, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n + offset)
    x = torch.randn(8 * n + offset, generator=g).to(device, torch.bfloat16)[offset:].view(8, n)  # offset: misaligned
    r = torch.randn(8, n, generator=g).to(device, torch.bfloat16)
    w = torch.randn(n, generator=g).to(device, torch.bfloat16)
    return x, r, w


def test_interpreter_takes_tritons_path(fuseaudit_device: str) -> None:
    if fuseaudit_device != "cpu":
        pytest.skip("the interpreter runs on the CPU")
    _launch.clear_cache()
    x, _, w = _inputs("cpu", 40)
    rms_norm(x, w)
    assert not _launch._PLANS, "no compiled kernel exists under the interpreter: no plan may be kept"


@pytest.mark.fuseaudit_gpu
def test_cached_launches_equal_tritons_own(fuseaudit_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same compiled kernel either way, so bitwise equal, on new data and on misaligned views."""
    if not fuseaudit_device.startswith("cuda"):
        pytest.skip("the cached path exists on a GPU only")
    _launch.clear_cache()
    for offset in (0, 0, 1, 1, 0):  # repeats hit the cache; an odd offset misaligns x (another specialisation)
        x, r, w = _inputs(fuseaudit_device, 1000, offset=offset)
        cached = (rms_norm(x, w), *add_rms_norm(x, r, w))
        monkeypatch.setattr(_launch, "ENABLED", False)  # what FUSEAUDIT_FAST_LAUNCH=0 sets
        plain = (rms_norm(x, w), *add_rms_norm(x, r, w))
        monkeypatch.setattr(_launch, "ENABLED", True)
        for a, b in zip(cached, plain):
            assert torch.equal(a, b), f"offset={offset}: the cached launch differs from Triton's own"
    assert len(_launch._PLANS) >= 4, "aligned and misaligned x must be cached apart, per kernel"


def test_plans_are_kept_by_the_inputs_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a kept plan may be reused for: same params and same shape/strides/dtype/device/alignment only."""
    monkeypatch.setattr(_launch, "ENABLED", True)  # as on a GPU, without one
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    _launch.clear_cache()
    built: list[str] = []

    def plan_for(label: str, params: tuple, *inputs) -> object:
        def build() -> object:
            built.append(label)
            return _launch.Plan(None, (1,), label)
        return _launch.planned(params, inputs, build)

    x = torch.zeros(4, 64)
    first = plan_for("x", ("op", 1e-6), x, None)
    assert plan_for("same metadata, new data", ("op", 1e-6), torch.ones(4, 64), None) is first
    plan_for("another eps", ("op", 1e-5), x, None)
    plan_for("transposed", ("op", 1e-6), torch.zeros(64, 4).t(), None)
    plan_for("bfloat16", ("op", 1e-6), x.bfloat16(), None)
    plan_for("misaligned", ("op", 1e-6), torch.zeros(4 * 64 + 1)[1:].view(4, 64), None)
    plan_for("with a residual", ("op", 1e-6), x, x)
    assert built == ["x", "another eps", "transposed", "bfloat16", "misaligned", "with a residual"]

    built.clear()
    for _ in range(2):  # not a tensor: no key, so build() runs (and raises its own error) every time
        plan_for("a list", ("op", 1e-6), [1.0, 2.0], None)
    assert built == ["a list", "a list"]

    def failing() -> object:
        raise ValueError("bad input")
    with pytest.raises(ValueError, match="bad input"):
        _launch.planned(("op", 0.5), (x,), failing)
    assert not any(key[0] == ("op", 0.5) for key in _launch._PLANS), "a failed build must not be kept"
    _launch.clear_cache()


def test_direct_launch_and_its_fallback_to_tritons_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept plan calls the launcher with the raw stream, integer pointers and no hooks; with a launch hook
    registered (launch counting, profilers) it takes Triton's own runner with the tensors instead."""
    import triton

    calls: list[tuple] = []

    class Compiled:  # stands in for Triton's CompiledKernel
        function, packed_metadata = "function", "packed"

        def run(self, *args):
            calls.append(("run", *args))

        def __getitem__(self, grid):
            return lambda *args: calls.append(("runner", grid, *args))

    class Kernel:  # stands in for a JITFunction
        arg_names = ("X", "Y", "n", "BLOCK")

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 3, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1000 + device, raising=False)
    plan = _launch.Plan(Kernel(), (5, 2), 77, BLOCK=64, num_warps=4)
    launch = _launch._launcher(plan, Compiled(), 2)
    assert launch is not None
    x, y = torch.zeros(8), torch.zeros(8)
    runtime = triton.knobs.runtime
    monkeypatch.setattr(runtime, "launch_enter_hook", None)
    monkeypatch.setattr(runtime, "launch_exit_hook", None)
    launch(x, y)
    assert calls.pop() == ("run", 5, 2, 1, 1003, "function", "packed", None, None, None,
                           x.data_ptr(), y.data_ptr(), 77, 64), "grid, stream of the current device, ints, trailing"
    hooked = type("Chain", (), {"calls": [print]})()  # a non-empty hook chain (Triton >= 3.5)
    monkeypatch.setattr(runtime, "launch_enter_hook", hooked)
    launch(x, y)
    name, grid, *args = calls.pop()
    assert (name, grid) == ("runner", (5, 2, 1)) and args[0] is x and args[1] is y and args[2:] == [77, 64]
    empty = type("Chain", (), {"calls": []})()
    monkeypatch.setattr(runtime, "launch_enter_hook", empty)
    monkeypatch.setattr(runtime, "launch_exit_hook", lambda metadata: None)  # Triton 3.4: a plain callable
    launch(x, y)
    assert calls.pop()[0] == "runner", "any registered hook, enter or exit, takes the runner"
    assert _launch._launcher(_launch.Plan(Kernel(), (1,), 77), Compiled(), 2) is None, \
        "a constexpr the plan does not name is left to Triton's binder"


def test_direct_c_launch_only_where_the_launcher_is_recognised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.5/3.6's launcher (run(...) only allocates scratch, then calls its C launch): a kept plan calls the
    C launch with what run(...) would pass on; a kernel with scratch, or a launcher of another form, keeps run(...)."""
    import triton

    calls: list[tuple] = []

    class Launcher:  # stands in for CudaLauncher of Triton 3.5 and 3.6
        launch_cooperative_grid, launch_pdl = False, True

        def __init__(self, global_scratch: int = 0, profile_scratch: int = 0) -> None:
            self.global_scratch_size, self.profile_scratch_size = global_scratch, profile_scratch
            self.launch = lambda *args: calls.append(("C launch", *args))

        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            calls.append(("run", gridX, gridY, gridZ, stream, function, *args))

    class OtherLauncher(Launcher):  # a later form: __call__ names its metadata and hooks
        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                     launch_enter_hook, launch_exit_hook, *args):
            calls.append(("run", gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                          launch_enter_hook, launch_exit_hook, *args))

    def compiled(run: Launcher) -> object:
        return type("Compiled", (), {"function": "function", "packed_metadata": "packed", "run": run,
                                     "__getitem__": lambda self, grid: (lambda *a: calls.append(("runner", *a)))})()

    class Kernel:
        arg_names = ("X", "Y", "n", "BLOCK")

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 3, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1000 + device, raising=False)
    runtime = triton.knobs.runtime
    monkeypatch.setattr(runtime, "launch_enter_hook", None)
    monkeypatch.setattr(runtime, "launch_exit_hook", None)
    plan = _launch.Plan(Kernel(), (5, 2), 77, BLOCK=64, num_warps=4)
    x, y = torch.zeros(8), torch.zeros(8)
    ptrs = (x.data_ptr(), y.data_ptr())

    _launch._launcher(plan, compiled(Launcher()), 2)(x, y)
    assert calls.pop() == ("C launch", 5, 2, 1, 1003, "function", False, True, None, None,
                           "packed", None, None, None, *ptrs, 77, 64), "cooperative, pdl, no scratch, then run's args"
    for run in (Launcher(global_scratch=128), Launcher(profile_scratch=64), OtherLauncher()):
        _launch._launcher(plan, compiled(run), 2)(x, y)
        assert calls.pop()[0] == "run", f"{type(run).__name__} {vars(run)}: run(...) decides what to pass"
    monkeypatch.setattr(runtime, "launch_exit_hook", lambda metadata: None)
    _launch._launcher(plan, compiled(Launcher()), 2)(x, y)
    assert calls.pop()[0] == "runner", "a registered hook still takes Triton's runner"


def test_a_plan_switches_to_the_launcher_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan's first launch takes ``kernel[grid]``; after it, ``plan.launch`` is the compiled kernel's launcher,
    or, where none can be built, ``kernel[grid]`` for good (the attempt is not repeated on every call)."""
    import triton

    calls: list[str] = []

    class Compiled:
        function, packed_metadata = "function", "packed"

        def run(self, *args):
            calls.append("run")

        def __getitem__(self, grid):
            return lambda *args: calls.append("runner")

    class Kernel:
        arg_names = ("X", "Y", "n", "BLOCK")

        def __getitem__(self, grid):
            return lambda *args, **meta: (calls.append("kernel[grid]"), Compiled())[1]

    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(triton.knobs.runtime, "launch_exit_hook", None)
    built: list[object] = []
    real = _launch._launcher
    monkeypatch.setattr(_launch, "_launcher", lambda *a: built.append(a) or real(*a))
    x, y = torch.zeros(4), torch.zeros(4)

    plan = _launch.Plan(Kernel(), (2,), 5, BLOCK=64)
    for _ in range(3):
        plan.launch(x, y)
    assert calls == ["kernel[grid]", "run", "run"] and len(built) == 1

    calls.clear()
    built.clear()
    unnamed = _launch.Plan(Kernel(), (2,), 5)  # BLOCK left to Triton's binder: no launcher can be built
    for _ in range(3):
        unnamed(x, y)
    assert calls == ["kernel[grid]"] * 3 and len(built) == 1, "the launcher is looked for once, not on every call"


def test_a_refused_cooperative_launch_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA refusing a cooperative grid (more programs than fit at once) hands the call to the plan's fallback,
    with a warning, for good; any other error of the launch is raised, fallback or not."""
    calls: list[str] = []

    class Refused:  # stands in for a JITFunction whose cooperative grid does not fit
        arg_names = ("X", "Y", "n")

        def __init__(self, message: str) -> None:
            self.message = message

        def __getitem__(self, grid):
            def launch(*args, **meta):
                calls.append("coop")
                raise RuntimeError(self.message)
            return launch

    class Plain:
        arg_names = ("X", "Y", "n")

        def __getitem__(self, grid):
            return lambda *args, **meta: calls.append(f"plain{grid}")

    monkeypatch.setattr(_launch, "ENABLED", False)  # kernel[grid] throughout: no launcher to build
    x, y = torch.zeros(4), torch.zeros(4)
    too_many = "Triton Error [CUDA]: too many blocks in cooperative launch"
    plan = _launch.Plan(Refused(too_many), (33, 8), 5, fallback=_launch.Plan(Plain(), (16384,), 5))
    with pytest.warns(RuntimeWarning, match="refused the cooperative launch") as caught:
        plan.launch(x, y)
    assert caught[0].filename == __file__, "the warning points at the call outside the kernels"
    plan.launch(x, y)
    assert calls == ["coop", "plain(16384,)", "plain(16384,)"], "the refused grid is not tried again"

    other = _launch.Plan(Refused("Triton Error [CUDA]: an illegal memory access was encountered"), (33, 8), 5,
                         fallback=_launch.Plan(Plain(), (16384,), 5))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        other.launch(x, y)
    alone = _launch.Plan(Refused(too_many), (33, 8), 5)
    with pytest.raises(RuntimeError, match="cooperative"):
        alone.launch(x, y)


def _keep_plans(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans kept on ``device``: on a GPU as shipped; on the CPU (interpreter) forced, launched by kernel[grid]."""
    if device == "cpu":
        monkeypatch.setattr(_launch, "ENABLED", True)
        monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    elif not _launch.ENABLED:
        pytest.skip("FUSEAUDIT_FAST_LAUNCH=0: no plan is kept")
    _launch.clear_cache()


def test_retuned_plans_follow_the_constants(fuseaudit_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans are keyed by the call, not by the tables and constants they were built from: ``retuned`` sets those,
    forgets the kept plans on entry and exit, and restores the old values even when the block raises."""
    from fuseaudit.kernels import _tuning, softmax
    from fuseaudit.kernels._tuning import RowConfig

    _keep_plans(fuseaudit_device, monkeypatch)
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)).to(fuseaudit_device)
    want = torch.softmax(x.double(), -1)

    def kernels() -> list[str]:
        return [plan.kernel.__name__ for plan in _launch._PLANS.values() if plan is not None]

    tables = _tuning.TABLES
    looped = {**tables, "softmax": tuple(row._replace(config=RowConfig("looped", warps=4, block_n=64))
                                         for row in tables["softmax"])}
    for _ in range(2):
        torch.testing.assert_close(softmax.softmax(x).double(), want)
    assert kernels() == ["softmax_kernel"], "one plan, kept: whole rows in the shipped table"
    with pytest.raises(KeyboardInterrupt), _launch.retuned(_tuning, TABLES=looped):
        assert not _launch._PLANS and _tuning.TABLES is looped
        torch.testing.assert_close(softmax.softmax(x).double(), want)
        assert kernels() == ["softmax_wide_kernel"], "the same call under a looped table loops"
        raise KeyboardInterrupt
    assert _tuning.TABLES is tables and not _launch._PLANS, "restored and forgotten, though the block raised"
    softmax.softmax(x)
    assert kernels() == ["softmax_kernel"]
    with pytest.raises(AttributeError), _launch.retuned(_tuning, TABLE=looped):  # misspelt: nothing is set
        pass
    assert not hasattr(_tuning, "TABLE")
    _launch.clear_cache()


def test_retuned_reaches_cached_tile_choices() -> None:
    """The table look-ups and splits are cached by their arguments, not by the tables and constants they read:
    ``retuned`` (through ``clear_cache``) forgets them, so a table changed after a first call is seen inside the
    block and the old one after it."""
    from fuseaudit.kernels import _coop, _tuning
    from fuseaudit.kernels._tuning import RowConfig, Split, TableRow

    def config() -> RowConfig:
        return _tuning.row_config("layer_norm", torch.bfloat16, 4096, 512)

    def splits() -> object:  # 8 wide rows on 132 SMs: split over programs unless MAX_ROWS is below 8
        return _coop._coop_config(8, 65536, 2, 132, _coop.knobs(), Split())

    shipped, other = config(), RowConfig("whole", warps=8)
    assert shipped != other and splits() is not None
    table = (TableRow(frozenset({"fp16", "bf16", "fp32"}), 1, None, 1, None, other),)
    with _launch.retuned(_tuning, TABLES={**_tuning.TABLES, "layer_norm": table}), _launch.retuned(_coop, MAX_ROWS=4):
        assert config() == other and splits() is None
    assert config() == shipped and splits() is not None


def test_no_test_patches_what_plans_are_built_from() -> None:
    """A kept plan outlives a plain patch of a kernel module's constants (it would run the old tile on a GPU):
    the tests change them through ``_launch.retuned`` only."""
    import pathlib
    import re

    patch = re.compile(r"(mock\.patch(\.object|\.multiple)?|monkeypatch\.setattr)\(\s*(_rows|_coop|_tuning|rms_norm|"
                       r"layer_norm|softmax|bias_act|gated|module)\b")
    found = [f"{path.name}:{number}" for path in sorted(pathlib.Path(__file__).parent.glob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if patch.search(line)]
    assert not found, f"use _launch.retuned for: {found}"


def test_outputs_are_row_major_whatever_the_input(fuseaudit_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept plan allocates its output with a plain ``empty_like`` only where the first input is contiguous: a
    transposed (dense) input would otherwise hand the kernel, which writes rows in order, a transposed output."""
    from fuseaudit.kernels import softmax

    _keep_plans(fuseaudit_device, monkeypatch)
    g = torch.Generator().manual_seed(1)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(fuseaudit_device)
    layouts = {"contiguous": t(6, 40), "transposed": t(40, 6).t(), "padded rows": t(6, 48)[:, :40]}
    for name, x in layouts.items():
        for call in ("plan built", "plan kept"):
            y = softmax.softmax(x)
            assert y.is_contiguous(), f"{name}, {call}: output strides {y.stride()}"
            torch.testing.assert_close(y.double(), torch.softmax(x.double(), -1), msg=f"{name}, {call}")
        (plan,) = [p for key, p in _launch._PLANS.items() if key[3] == x.stride()]
        assert plan.row_major == (name == "contiguous"), name
    assert _launch.output_like(layouts["transposed"], None).is_contiguous(), "no plan: a row-major allocation"
    _launch.clear_cache()


def test_late_values_and_an_autotuned_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """``late`` values follow the tensors and the scratch; a plan of an autotuned kernel launches through the
    autotuner once, then the kernel itself with the config the autotuner chose."""
    import triton
    from triton.runtime.autotuner import Autotuner

    calls: list[tuple] = []

    class Compiled:
        function, packed_metadata = "function", "packed"

        def run(self, *args):
            calls.append(("run", *args))

        def __getitem__(self, grid):
            return lambda *args: calls.append(("runner", *args))

    class Kernel:
        arg_names = ("X", "Y", "W", "S", "n", "BLOCK", "TILE")

    class Tuner(Autotuner):  # stands in for triton.autotune(...)(Kernel), its first launch done
        def __init__(self) -> None:
            self.fn, self.arg_names = Kernel(), Kernel.arg_names
            self.best_config = triton.Config({"TILE": 32}, num_warps=8)

        def __getitem__(self, grid):
            return lambda *args, **meta: (calls.append(("tuner", grid, *args, meta)), Compiled())[1]

    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(triton.knobs.runtime, "launch_exit_hook", None)
    x, y, w = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    plan = _launch.Plan(Tuner(), (3,), 77, late=1, scratch=lambda device: (w,), BLOCK=64)
    plan.launch(x, y, 5)
    assert calls.pop() == ("tuner", (3,), x, y, w, 5, 77, {"BLOCK": 64}), "tensors, scratch, late values, scalars"
    assert isinstance(plan.kernel, Kernel) and plan.meta["TILE"] == 32 and plan.meta["num_warps"] == 8
    plan.launch(x, y, 6)
    assert calls.pop() == ("run", 3, 1, 1, 7, "function", "packed", None, None, None,
                           x.data_ptr(), y.data_ptr(), w.data_ptr(), 6, 77, 64, 32), "the chosen config, fixed"


def _decode_inputs(device: str, B: int, H: int, Hkv: int, D: int, cache: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(B * H + cache)
    q = torch.randn(B, 1, H, D, generator=g).to(device, torch.float16).transpose(1, 2)  # as transformers passes q
    k, v = (torch.randn(B, Hkv, cache, D, generator=g).to(device, torch.float16) for _ in range(2))
    return q, k, v


# (B, H, Hkv, D, steps): under the interpreter (16-key chunks, 8 pretend SMs) the first splits its keys, its
# chunk and split count changing over these steps; the second (8 programs) never splits, Sk crossing 128
@pytest.mark.parametrize("B,H,Hkv,D,steps", [(1, 8, 2, 64, range(120, 136)), (1, 8, 8, 16, range(126, 131))])
def test_kept_decode_plans_follow_a_growing_cache(fuseaudit_device: str, monkeypatch: pytest.MonkeyPatch,
                                                  B: int, H: int, Hkv: int, D: int, steps: range) -> None:
    """Decoding over a growing KV cache (``Sk`` one more each step, across split and 16-key boundaries): kept
    plans give the same bits as the full path, and are kept by what ``Sk`` decides, not by ``Sk`` itself."""
    from fuseaudit.kernels import attention as attn

    if fuseaudit_device == "cpu":  # plans are kept on a GPU only; here they are kept, each launched by Triton
        monkeypatch.setattr(_launch, "ENABLED", True)
        monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    _launch.clear_cache()
    q, k, v = _decode_inputs(fuseaudit_device, B, H, Hkv, D, 160)
    for sk in steps:
        kept = attn.attention(q, k[:, :, :sk], v[:, :, :sk])
        monkeypatch.setattr(_launch, "ENABLED", False)
        full = attn.attention(q, k[:, :, :sk], v[:, :, :sk])
        monkeypatch.setattr(_launch, "ENABLED", True)
        assert torch.equal(kept, full), f"Sk={sk}: the kept plan differs from the full path"
    splits = {attn._num_splits(B * Hkv, sk, q.device)[0] for sk in steps}
    assert len(_launch._PLANS) <= 6 * len(splits), f"{len(_launch._PLANS)} plans for {len(steps)} steps"
    with pytest.raises(ValueError, match="k and v must have one shape"):
        attn.attention(q, k[:, :, :100], v[:, :, :101])
    _launch.clear_cache()
