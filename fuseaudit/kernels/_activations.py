"""Activation functions shared by the pointwise and gated kernels, in float32.

    gelu(x)       = x * Phi(x)            = 0.5 * x * (1 + erf(x / sqrt(2)))
    gelu_tanh(x)  = 0.5 * x * (1 + tanh(z)),  z = sqrt(2/pi) * (x + 0.044715 x^3)
                  = x * sigmoid(2 z)      (the same function, with no tanh and no
                                           cancellation of 1 + tanh(z) for z << 0)
    silu(x)       = x * sigmoid(x)

The identity 1 + tanh(z) = 2 * sigmoid(2z) lets us avoid libdevice's tanh,
which differs between Triton versions and is not in the interpreter.
"""

import triton
import triton.language as tl

# Compile-time selectors for the ``ACTIVATION: tl.constexpr`` kernel argument.
GELU = 0
GELU_TANH = 1
SILU = 2

SQRT1_2 = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
SQRT2_PI = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def apply_activation(x, ACTIVATION: tl.constexpr):
    """``x`` is float32; returns the activation in float32."""
    if ACTIVATION == 0:
        y = 0.5 * x * (1.0 + tl.erf(x * SQRT1_2))
    elif ACTIVATION == 1:
        z = SQRT2_PI * (x + 0.044715 * x * x * x)
        y = x * sigmoid(2.0 * z)
    else:
        y = x * sigmoid(x)
    return y


def gelu_code(approximate: str) -> int:
    """Map ``F.gelu``'s ``approximate`` argument to the kernel selector."""
    if approximate == "none":
        return GELU
    if approximate == "tanh":
        return GELU_TANH
    raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
