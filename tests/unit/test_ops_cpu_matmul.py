"""ops.cpu_matmul: fp32 CPU GEMMs routed to oneDNN give the float64 reference's results to fp32 rounding, forward and
backward (autograd records exactly as without the mode), and everything else passes through untouched."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_ppo.ops import cpu_matmul
from megatron_ppo.ops.cpu_matmul import onednn_available, onednn_matmul

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear op")


@pytest.fixture
def routed(monkeypatch):
    """The (a, b, bias) shapes of every GEMM the mode sent to oneDNN."""
    calls = []
    real = cpu_matmul.onednn_mm

    def spy(a, b, bias=None):
        calls.append((tuple(a.shape), tuple(b.shape), None if bias is None else tuple(bias.shape)))
        return real(a, b, bias)

    monkeypatch.setattr(cpu_matmul, "onednn_mm", spy)
    return calls


def _close(got, ref64, k):
    """fp32 against a float64 reference: error bounded by the summation length times the operands' scale."""
    assert got.dtype == torch.float32 and got.shape == ref64.shape
    err = (got.double() - ref64).abs().max().item()
    assert err <= 1e-6 * k ** 0.5 * max(ref64.abs().max().item(), 1.0), err


def test_megatron_linear_gemms_match_float64(routed):
    g = torch.Generator().manual_seed(0)
    m, n, k = 37, 23, 19
    x, w = torch.randn(3, m, k, generator=g), torch.randn(n, k, generator=g)  # [s, b, K] as megatron's layers
    dy = torch.randn(3 * m, n, generator=g)
    with onednn_matmul():
        fwd = torch.matmul(x, w.t())  # forward x W^T (3-D input)
        dgrad = dy.matmul(w)  # input gradient dY W
        wgrad = dy.t().matmul(x.reshape(-1, k))  # weight gradient dY^T X (both operands transposed views)
    _close(fwd, torch.matmul(x.double(), w.double().t()), k)
    _close(dgrad, dy.double() @ w.double(), n)
    _close(wgrad, dy.double().t() @ x.double().reshape(-1, k), 3 * m)
    assert routed == [((3 * m, k), (k, n), None), ((3 * m, n), (n, k), None), ((n, 3 * m), (3 * m, k), None)]


def test_linear_with_bias_and_its_gradients_match_float64(routed):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(29, 13, generator=g, requires_grad=True)
    w = torch.randn(11, 13, generator=g, requires_grad=True)
    b = torch.randn(11, generator=g, requires_grad=True)
    up = torch.randn(29, 11, generator=g)
    with onednn_matmul():
        y = F.linear(x, w, b)
        (y * up).sum().backward()
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    y64 = F.linear(x64, w64, b64)
    (y64 * up.double()).sum().backward()
    _close(y, y64.detach(), 13)
    for got, ref in ((x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        _close(got, ref, 29)
    # forward addmm (bias fused), input gradient and weight gradient all went through oneDNN
    assert [c[2] for c in routed] == [(11,), None, None] and len(routed) == 3


def test_everything_else_passes_through(routed):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(8, 5, generator=g), torch.randn(5, 6, generator=g)
    bias = torch.randn(6, generator=g)
    with onednn_matmul():
        mm64 = a.double() @ b.double()  # other dtypes
        scaled = [torch.addmm(bias, a, b, beta=beta, alpha=alpha) for beta, alpha in ((0.5, 1.0), (1.0, 2.0))]
        full_bias = torch.addmm(torch.arange(36.0).view(6, 6), a[:6], b)  # an [M, N] term to add, not a bias
        batched = torch.bmm(a[None], b[None])  # batched (attention)
        vec = a @ b[:, 0]  # matrix-vector
        empty = torch.randn(0, 5) @ b
    assert routed == []
    assert torch.allclose(scaled[0], 0.5 * bias + a @ b, atol=1e-5)
    assert torch.allclose(full_bias, torch.arange(36.0).view(6, 6) + a[:6] @ b, atol=1e-5)
    assert torch.allclose(scaled[1], bias + 2.0 * (a @ b), atol=1e-5)
    assert torch.allclose(mm64, a.double() @ b.double()) and torch.allclose(batched[0], a @ b)
    assert torch.allclose(vec, a @ b[:, 0]) and empty.shape == (0, 6)


def test_disabled_routes_nothing(routed):
    a, b = torch.randn(8, 5), torch.randn(5, 6)
    with onednn_matmul(False):
        out = a @ b
    assert routed == [] and torch.equal(out, a @ b)
