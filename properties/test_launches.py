"""Launch counting: every reference kernel is one launch; eager is counted beside it."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuseaudit.case import materialize
from fuseaudit.catalog import OPS
from fuseaudit.launches import count_launches, short_name
from fuseaudit.strategies import cases

REFERENCE_OPS = [op for op in OPS.values() if op.reference]


@pytest.mark.parametrize("spec", REFERENCE_OPS, ids=[op.name for op in REFERENCE_OPS])
@settings(max_examples=4, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_reference_launches(spec, data, fuseaudit_device, record_property):
    """Exactly the catalog's expected launches, on any layout; eager's count recorded beside it."""
    case = data.draw(cases(spec), label="case")
    inputs = materialize(case, fuseaudit_device)
    args = [inputs[n] for n in spec.input_names]
    fused = count_launches(spec.load_reference(), *args, device=fuseaudit_device, **case.params)
    eager = count_launches(spec.eager, *args, device=fuseaudit_device, **case.params)
    record_property(f"{spec.name}_eager_launches", eager.count)
    assert fused.count == spec.launches, (
        f"{spec.name}: expected {spec.launches} launch(es), got {fused.describe()} on {case.describe()}")
    assert eager.count >= 1, f"eager {spec.name} launched nothing we could see: {eager.describe()}"


# kernel names as the CUDA profiler reports them (H200, torch 2.11): SDPA's memory-efficient kernel is a
# plain function whose parameter is a template; flash's and aten's kernels are templates
CUTLASS_FMHA = ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<"
                "cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)")
FLASH = ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
         "cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, false, false, "
         "false, true, true, false, false>(pytorch_flash::Flash_fwd_params)")
GELU = ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
        "at::native::GeluType)::{lambda()#1}::operator()() const::{lambda()#4}::operator()() const::"
        "{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int, at::native::GeluCUDAKernelImpl(at::"
        "TensorIteratorBase&, at::native::GeluType)::{lambda()#1}::operator()() const::{lambda()#4}::operator()() "
        "const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul>)")
CAT = ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>, "
       "unsigned int, 4, 128, 1>(at::native::(anonymous namespace)::OpaqueType<2u>*, int)")


@pytest.mark.parametrize(("demangled", "short"), [
    (CUTLASS_FMHA, "fmha_cutlassF_bf16_aligned_64x128_rf_sm80"),
    (FLASH, "flash_fwd_kernel[Flash_fwd_kernel_traits]"),
    (GELU, "vectorized_elementwise_kernel[GeluCUDAKernelImpl]"),
    (CAT, "CatArrayBatchedCopy"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0"),
    ("aten::add", "aten::add"),
], ids=["cutlass-fmha", "flash", "aten-gelu", "anonymous-namespace", "triton", "interpreter"])
def test_short_name_names_the_kernel_not_a_template_parameter(demangled, short):
    assert short_name(demangled) == short


def test_eager_compositions_are_counted(fuseaudit_device):
    """The unfused residual_bias_gelu is add, add, gelu: three launches, named."""
    spec = OPS["residual_bias_gelu"]
    case = _fixed_case(spec)
    inputs = materialize(case, fuseaudit_device)
    count = count_launches(spec.eager, *(inputs[n] for n in spec.input_names), device=fuseaudit_device)
    assert count.count == 3, count.describe()


def _fixed_case(spec):
    from fuseaudit.case import Case

    return Case(spec.name, "float16", {"lead": (4, 3), "N": 257}, {}, "normal", {}, 0)


MARKED_TESTS = """
import pytest, torch
from fuseaudit.catalog import OPS

def _inputs():
    return torch.randn(4, 64, dtype=torch.float16), torch.randn(4, 64, dtype=torch.float16), \\
        torch.randn(64, dtype=torch.float16)

@pytest.mark.fused(launches=1)
def test_fused(fuseaudit_launches):
    f, args = OPS["residual_bias_gelu"].load_reference(), _inputs()
    f(*args)
    with fuseaudit_launches:
        f(*args)

@pytest.mark.fused(launches=1)
def test_fake_fusion(fuseaudit_launches):
    f, args = OPS["residual_bias_gelu"].eager, _inputs()
    with fuseaudit_launches:
        f(*args)

@pytest.mark.fused(launches=1)
def test_forgot_fixture():
    pass
"""


def test_fused_marker(pytester, fuseaudit_device):
    """The marker passes a one-launch kernel and fails a three-launch one, naming the kernels."""
    if fuseaudit_device != "cpu":
        pytest.skip("the marker's CPU behaviour is tested here; on a GPU the property above covers it")
    pytester.makepyfile(MARKED_TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--fuseaudit-device=cpu")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines([
        "*expected 1 launch(es) per fused call, block 1 launched 3 kernel(s): aten::add, aten::add, aten::gelu*",
        "*no launches were counted*",
    ])


README_EXAMPLE = '''
import time

from fuseaudit.catalog import get_op
from fuseaudit.check import run_case
from fuseaudit.strategies import cases
from hypothesis import given

spec = get_op("swiglu")


_first = [True]


def my_swiglu(gate, up):  # the first call is slower than Hypothesis's default deadline (200 ms): a compile
    if _first[0]:
        _first[0] = False
        time.sleep(0.3)
    return (gate.float() * gate.float().sigmoid() * up.float()).to(gate.dtype)


@given(cases(spec))
def test_my_swiglu(case):
    run_case(spec, my_swiglu, case, device="cpu", target="mine:my_swiglu").raise_for_failures()
'''


def test_readme_hypothesis_example_passes_without_a_profile(pytester, monkeypatch):
    """The README's own-tests example, as written (on the CPU): no deadline fails a correct kernel."""
    monkeypatch.delenv("FUSEAUDIT_PROFILE", raising=False)  # a user's shell has none
    pytester.makepyfile(README_EXAMPLE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--fuseaudit-device=cpu", "-q")
    result.assert_outcomes(passed=1)
