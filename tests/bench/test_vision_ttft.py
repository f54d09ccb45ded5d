"""`python3 -m bench.vision_ttft` runs (one repeat) and reports a row per image count, each prompt
with images timed against a text-only prompt of its token count, with the encoder's time inside it;
`--real-shape`'s pairing of a tower and a text model of given shapes runs on tiny shapes."""

from __future__ import annotations

import pytest

from bench import vision_ttft
from bench.gpu_check.shapes import TINY_GEMMA3
from checkpoints.tiny_vlm import TINY_TOWER


def test_vision_figures_run(capsys):
    *rows, turn = vision_ttft.main(["--repeats", "1"])
    assert [r["images"] for r in rows] == [1, 2, 4]
    assert [r["prompt_tokens"] for r in rows] == sorted(r["prompt_tokens"] for r in rows)
    assert rows[2]["prompt_tokens"] - rows[0]["prompt_tokens"] == 3 * 22  # 16 soft tokens and 6 markers an image
    assert all(r["encoder_ms_per_image"] > 0 and r["ttft_text_ms"] > 0 for r in rows)
    assert all(0 < r["encoder_share"] < 1 for r in rows)  # the encoder's calls are part of the TTFT
    assert turn["ttft_cached_image_ms"] > 0 and turn["ttft_new_image_ms"] > 0 and turn["cached_over_new"] > 0
    assert "| 4 |" in capsys.readouterr().out


def test_a_tower_paired_with_a_text_model_of_another_shape():
    """`--real-shape` builds `paired_vlm(GEMMA3_270M, GEMMA3_4B_TOWER)` and runs it with `REAL_SHAPE`; here
    the same code on tiny shapes: the projector maps the tower's features to the text model's."""
    model = vision_ttft.paired_vlm(TINY_GEMMA3, dict(TINY_TOWER, mm_tokens_per_image=4))
    assert model.vision.config.text_hidden_size == TINY_GEMMA3.hidden_size
    assert model.vision.params["projector"]["kernel"].shape == (TINY_TOWER["hidden_size"], TINY_GEMMA3.hidden_size)
    *rows, turn = vision_ttft.run(model, vision_ttft.REAL_SHAPE, repeats=1)
    assert rows[2]["prompt_tokens"] - rows[0]["prompt_tokens"] == 3 * (4 + 6)  # 4 soft tokens an image
    assert all(r["ttft_image_ms"] > 0 for r in rows) and turn["ttft_new_image_ms"] > 0


def test_real_shape_is_gemma3s():
    with pytest.raises(SystemExit):
        vision_ttft.main(["--real-shape", "--model", "smolvlm"])
