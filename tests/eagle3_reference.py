"""A numpy reference of an EAGLE-3 head (vLLM's `llama_eagle3`, written from its formula, not from
`jaxserve.speculative.eagle3_model`) that the tests check greedy drafts against: one position at a time, each
attending to the keys and values of the positions before it and its own (plain RoPE, no scaling)."""

from __future__ import annotations

import numpy as np

from checkpoints.config import ModelConfig


def _rms(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x: np.ndarray, position: int, theta: float) -> np.ndarray:
    """x [heads, D] rotated by half-splitting (Llama's layout)."""
    d = x.shape[-1]
    angles = position * theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(np.concatenate([angles, angles])), np.sin(np.concatenate([angles, angles]))
    return x * cos + np.concatenate([-x[:, d // 2 :], x[:, : d // 2]], axis=-1) * sin


class Eagle3Reference:
    """The head over one sequence: `step(token, g, position)` -> (the draft's target id, h' fed on)."""

    def __init__(self, cfg: ModelConfig, params: dict[str, np.ndarray]) -> None:
        self.cfg, self.p = cfg, {name: np.asarray(a, np.float64) for name, a in params.items()}
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []

    def step(self, token: int, g: np.ndarray, position: int) -> tuple[int, np.ndarray]:
        cfg, p, eps = self.cfg, self.p, self.cfg.rms_norm_eps
        normed = _rms(g, p["hidden_norm"], eps)
        x = np.concatenate([_rms(p["embedding"][token], p["input_norm"], eps), normed])
        q = _rope((x @ p["q_proj"]).reshape(cfg.num_heads, cfg.head_dim), position, cfg.rope_theta)
        self.keys.append(_rope((x @ p["k_proj"]).reshape(cfg.num_kv_heads, cfg.head_dim), position, cfg.rope_theta))
        self.values.append((x @ p["v_proj"]).reshape(cfg.num_kv_heads, cfg.head_dim))
        k, v = np.stack(self.keys), np.stack(self.values)  # [n, kv heads, D]
        group = cfg.num_heads // cfg.num_kv_heads
        out = np.empty_like(q)
        for head in range(cfg.num_heads):
            scores = k[:, head // group] @ q[head] / np.sqrt(cfg.head_dim)
            weights = np.exp(scores - scores.max())
            out[head] = weights / weights.sum() @ v[:, head // group]
        h = g + out.reshape(-1) @ p["o_proj"]
        y = _rms(h, p["post_attention_norm"], eps)
        gate = y @ p["gate_proj"]
        h = h + (gate / (1 + np.exp(-gate)) * (y @ p["up_proj"])) @ p["down_proj"]
        draft = int(np.argmax(p["lm_head"] @ _rms(h, p["norm"], eps)))
        return int(p["targets"][draft]), h


def reference_chain(cfg: ModelConfig, params: dict, aux: np.ndarray, tokens: list[int], k: int) -> list[int]:
    """The greedy drafts after `tokens` (N of them): positions 0 .. N - 2 from the target's aux rows [N - 1, 3E]
    through fc, then k - 1 more chained on the head's own output."""
    ref = Eagle3Reference(cfg, params)
    fc = np.asarray(params["fc"], np.float64)
    for position in range(len(tokens) - 1):
        draft, h = ref.step(tokens[position + 1], aux[position] @ fc, position)
    drafts = [draft]
    for j in range(1, k):
        draft, h = ref.step(drafts[-1], h, len(tokens) - 2 + j)
        drafts.append(draft)
    return drafts
