"""A small random DSpark drafter for the kernel tests (test_native.py, test_native_avx2.py): shapes the fused calls
take, a vanilla Markov head and a confidence head."""
from __future__ import annotations

import torch


def kernel_drafter(dtype=torch.bfloat16, pack=True, head_dim=16, markov_rank=16):
    """Two layers, hidden 64, vocabulary 400, block 5, Markov rank 16 unless said; packed for inference (DSparkDrafter.pack) unless
    pack is False."""
    from dspark.drafters import DrafterConfig, DSparkDrafter

    gen = torch.Generator().manual_seed(3)
    v, d = 400, 64
    heads = d // head_dim
    cfg = DrafterConfig(hidden_size=d, intermediate_size=128, num_attention_heads=heads,
                        num_key_value_heads=heads // 2, head_dim=head_dim, vocab_size=v, target_layer_ids=(0, 2), mask_token_id=v - 1, num_layers=2,
                        block_size=5, markov_rank=markov_rank)
    torch.manual_seed(3)
    model = DSparkDrafter(cfg, torch.randn(v, d, generator=gen), torch.randn(v, d, generator=gen))
    model.init_weights(0.2)
    model = model.to(dtype).eval()
    return model.pack() if pack else model
