"""RMSNorm's inference path (one layer_norm over [x, -x]) against the reference formula."""
import pytest
import torch

from dspark.models.layers import RMSNorm


def reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return w.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_rmsnorm_matches_the_reference(dtype, tol):
    torch.manual_seed(0)
    norm = RMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    norm = norm.to(dtype)
    x = (torch.randn(5, 96) * 3 + 1).to(dtype)  # a non-zero mean: layer_norm alone would subtract it
    with torch.inference_mode():
        fast = norm(x)
    with torch.enable_grad():
        slow = norm(x.clone().requires_grad_(True))  # the autograd path (F.rms_norm)
    want = reference(x, norm.weight, 1e-5)
    assert fast.dtype == dtype and fast.shape == x.shape
    torch.testing.assert_close(fast.float(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(slow.detach().float(), want, atol=tol, rtol=tol)


def test_rmsnorm_rows_are_independent():
    torch.manual_seed(1)
    norm = RMSNorm(64).to(torch.bfloat16)
    x = torch.randn(9, 64).to(torch.bfloat16)
    with torch.inference_mode():
        together = norm(x)
        alone = torch.cat([norm(x[i:i + 1]) for i in range(9)])
    assert torch.equal(together, alone)


def test_rmsnorm_follows_weight_updates():
    norm = RMSNorm(32)
    x = torch.randn(2, 32)
    with torch.no_grad():
        before = norm(x)
        norm.weight.mul_(2.0)  # as an optimizer step does: in place
        after = norm(x)
    torch.testing.assert_close(after, 2 * before)
