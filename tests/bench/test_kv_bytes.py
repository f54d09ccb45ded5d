"""bench/kv_bytes.py: DeepSeek-V3's KV bytes per token from the engine's cache layout equal the
arithmetic of each attention (61 layers, bf16)."""

from __future__ import annotations

from bench.kv_bytes import DEEPSEEK_V3_CONFIG, figures, main
from checkpoints.architectures import config_from_hf


def test_latent_cache_is_a_fraction_of_gqa_and_mha(capsys):
    (_, mla), (_, gqa), (_, mha) = figures()
    assert mla == 61 * (512 + 64) * 2  # one latent and one rope key per token and layer, no heads
    assert gqa == 61 * 2 * 8 * 128 * 2
    assert mha == 61 * 128 * (192 + 128) * 2
    main()
    assert "3.56x MLA's" in capsys.readouterr().out


def test_the_published_config_loads_as_deepseek_v3():
    config = config_from_hf(DEEPSEEK_V3_CONFIG)
    assert config.is_mla and config.moe_layers == 58 and config.num_nextn_predict_layers == 1
    assert config.head_dim == 64 and config.rope_scaling["factor"] == 40
