"""Targets that misbehave as processes, for the isolation tests (op bias_gelu; correct when they run)."""

import ctypes
import os
import time

import torch.nn.functional as F


def raises_above_64(x, bias, approximate="none"):
    if x.shape[-1] > 64:
        raise ValueError(f"hidden size {x.shape[-1]} is not supported")
    return F.gelu(x + bias, approximate=approximate)


def segfaults_on_narrow_rows(x, bias, approximate="none"):
    if x.shape[-1] < 8:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return F.gelu(x + bias, approximate=approximate)


def hangs_on_narrow_rows(x, bias, approximate="none"):
    while x.shape[-1] < 8:  # never returns
        time.sleep(0.05)
    return F.gelu(x + bias, approximate=approximate)


def aborts_on_half(x, bias, approximate="none"):
    if x.dtype.itemsize == 2:
        os.abort()  # SIGABRT
    return F.gelu(x + bias, approximate=approximate)


def wrong_signature(x):
    return F.gelu(x)


def misaligned_on_half(x, bias, approximate="none"):
    if x.dtype.itemsize == 2:  # as on a GPU: the call faults, and releasing the judge's CUDA buffers aborts
        import os

        from fuseaudit import channel

        channel.Mapper.forget = lambda self: os.abort()
        raise RuntimeError("CUDA error: misaligned address")
    return F.gelu(x + bias, approximate=approximate)


def illegal_access_on_half(x, bias, approximate="none"):
    if x.dtype.itemsize == 2:  # what a kernel writing out of bounds leaves behind on a GPU
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return F.gelu(x + bias, approximate=approximate)
