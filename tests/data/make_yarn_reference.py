"""Writes yarn_reference.json: YaRN inverse frequencies and attention factors computed by
Hugging Face transformers, the reference `jaxserve.model.rope` is tested against.

Run with a Python that has transformers and torch: `python tests/data/make_yarn_reference.py`.
"""

import json
from pathlib import Path

import transformers
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

CASES = [
    # (head_dim, rope_theta, max_position_embeddings, rope_scaling)
    (64, 10000.0, 16384, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}),
    (128, 1000000.0, 131072, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    (
        64,
        500000.0,
        65536,
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "beta_fast": 16,
            "beta_slow": 2,
            "truncate": False,
        },
    ),
    (
        64,
        10000.0,
        16384,
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    ),
    (
        64,
        10000.0,
        16384,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "attention_factor": 1.5},
    ),
]


def main() -> None:
    out = []
    for head_dim, theta, max_pos, scaling in CASES:
        config = LlamaConfig(
            hidden_size=head_dim * 4,
            num_attention_heads=4,
            head_dim=head_dim,
            rope_theta=theta,
            max_position_embeddings=max_pos,
            rope_scaling=dict(scaling),
        )
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        out.append(
            {
                "head_dim": head_dim,
                "rope_theta": theta,
                "max_position_embeddings": max_pos,
                "rope_scaling": scaling,
                "inv_freq": inv_freq.tolist(),
                "attention_factor": attention_factor,
            }
        )
    path = Path(__file__).with_name("yarn_reference.json")
    path.write_text(json.dumps({"transformers": transformers.__version__, "cases": out}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
